"""Assistant loss masks on 23 real chat templates (``tests/templates``), with and without generation markers.

Each template runs on the tiny target's tokenizer with the template's special tokens added, so
nothing is downloaded. Templates without ``{% generation %}`` markers must mask exactly each
assistant content plus its end-of-turn token; Mistral's templates put a space before the content,
and that space is masked too (it is glued to the first word's token).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TINY_TARGET
from mtp_train.errors import UserError
from mtp_train.data.chat_mask import has_generation_markers
from mtp_train.data.dataset import encode_many

TEMPLATES = Path(__file__).resolve().parent / "templates"  # real templates, credited in its README.md


@dataclass(frozen=True)
class Case:
    """How a template's tokenizer looks: bos/eos, the end-of-turn token, other special tokens."""

    bos: str | None
    eos: str
    eot: str
    tokens: tuple[str, ...]
    system_ok: bool = True  # False: the template raises on a system message
    space: bool = False  # the template renders " " + content


DS_END = "<｜end▁of▁sentence｜>"
DEEPSEEK = Case("<｜begin▁of▁sentence｜>", DS_END, DS_END, ("<｜User｜>", "<｜Assistant｜>"))
LLAMA3 = Case("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>"))
LLAMA31 = Case(LLAMA3.bos, LLAMA3.eos, LLAMA3.eot, LLAMA3.tokens + ("<|eom_id|>", "<|python_tag|>"))
GEMMA = Case("<bos>", "<eos>", "<end_of_turn>", ("<start_of_turn>",), system_ok=False)
MISTRAL = Case("<s>", "</s>", "</s>", ("[INST]", "[/INST]"), space=True)
PHI3 = Case("<s>", "<|endoftext|>", "<|end|>", ("<|system|>", "<|user|>", "<|assistant|>"))
CHATML = Case(None, "<|im_end|>", "<|im_end|>", ("<|im_start|>",))
CHATML_THINK = Case(None, "<|im_end|>", "<|im_end|>", ("<|im_start|>", "<think>", "</think>"))

CASES = {
    "deepseek-r1-2025-01-snapshot": DEEPSEEK,
    "deepseek-r1": DEEPSEEK,
    "deepseek-v3.1": DEEPSEEK,
    "gemma-2-2b-it": GEMMA,
    "lfm2.5-230m": Case("<|startoftext|>", "<|im_end|>", "<|im_end|>", ("<|im_start|>", "<think>", "</think>")),
    "llama-3-8b-instruct": LLAMA3,
    "llama-3.1-8b-instruct": LLAMA31,
    "llama-3.3-70b-instruct": LLAMA31,
    "mistral-7b-instruct-v0.3": MISTRAL,
    "phi-3-mini-4k-instruct": PHI3,
    "qwen2.5-7b-instruct": CHATML,
    "qwen3-8b": CHATML_THINK,
    "smollm2-135m-instruct": CHATML,
    "smollm3-3b": CHATML_THINK,
    "trl-deepseekv3_training": DEEPSEEK,
    "trl-gemma3_training": Case(GEMMA.bos, GEMMA.eos, GEMMA.eot, GEMMA.tokens),  # Gemma 3 folds the system in
    "trl-gemma_training": GEMMA,
    "trl-llama3_training": LLAMA3,
    "trl-mistral_training": MISTRAL,
    "trl-phi3_5_training": PHI3,
    "trl-phi3_training": PHI3,
    "trl-qwen2_5_training": CHATML,
    "trl-qwen3_training": CHATML_THINK,
}

SYSTEM = {"role": "system", "content": "You are a terse geography assistant."}
CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]
ASSISTANT = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
OTHERS = [m["content"] for m in CONVERSATION if m["role"] != "assistant"]


@pytest.fixture(scope="module")
def base_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_TARGET)


def template_tokenizer(base, case: Case, template: str):
    """The tiny tokenizer with ``case``'s special tokens and ``template`` as its chat template."""
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"eos_token": case.eos, **({"bos_token": case.bos} if case.bos else {})})
    tok.add_tokens([case.eot, *case.tokens], special_tokens=True)
    tok.chat_template = template
    return tok


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each run of consecutive masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return [tok.decode(r, clean_up_tokenization_spaces=False) for r in runs]


def test_every_template_file_has_a_case():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_assistant_mask_on_real_template(name, base_tokenizer):
    path = TEMPLATES / f"{name}.jinja"
    case = CASES[name]
    template = path.read_text()
    tok = template_tokenizer(base_tokenizer, case, template)
    conv = CONVERSATION if case.system_ok else CONVERSATION[1:]
    (ids, mask, truncated), = encode_many(tok, [conv], 100_000, row_ids=[3])
    assert not truncated
    assert ids == list(tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
    runs = masked_runs(tok, ids, mask)
    if has_generation_markers(template):
        text = "".join(runs)
        assert all(a in text for a in ASSISTANT), runs
        assert not any(o in text for o in OTHERS), runs
    else:
        lead = " " if case.space else ""
        assert runs == [lead + a + case.eot for a in ASSISTANT]


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c.system_ok))
def test_template_that_rejects_a_system_message_names_the_row(name, base_tokenizer):
    path = TEMPLATES / f"{name}.jinja"
    tok = template_tokenizer(base_tokenizer, CASES[name], path.read_text())
    ok = CONVERSATION[1:]
    with pytest.raises(UserError) as err:
        encode_many(tok, [ok, ok, CONVERSATION], 512, row_ids=[10, 11, 12])
    message = str(err.value)
    assert "row 12" in message and "System role not supported" in message
    assert "data.chat_template" in message and len(message.splitlines()) == 1


def tiny_without_markers(base):
    tok = copy.deepcopy(base)
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert not has_generation_markers(tok.chat_template)
    return tok


def test_template_without_markers_masks_through_encode_many(base_tokenizer):
    tok = tiny_without_markers(base_tokenizer)
    rows = [
        CONVERSATION,
        CONVERSATION[1:4],  # ends with a user turn: nothing after the last answer's end marker
        "plain text row",
        [{"role": "user", "content": "MTPSPAN0Q?"}, {"role": "assistant", "content": "MTPSPAN0Q, said the user."}],
    ]
    encoded = encode_many(tok, rows, 512, row_ids=[0, 1, 2, 3])
    expected = [
        [a + "<|eot|>" for a in ASSISTANT], [ASSISTANT[0] + "<|eot|>"], None, ["MTPSPAN0Q, said the user.<|eot|>"]
    ]
    for row, (ids, mask, _), want in zip(rows, encoded, expected):
        if isinstance(row, str):
            assert mask == [0] + [1] * (len(ids) - 1)
            continue
        assert ids == list(tok.apply_chat_template(row, tokenize=True, return_dict=True)["input_ids"])
        assert masked_runs(tok, ids, mask) == want
    # The same rows through the original template with markers give the same ids and masks.
    assert encode_many(base_tokenizer, rows, 512) == encoded


def test_truncation_cuts_ids_and_mask_together(base_tokenizer):
    tok = tiny_without_markers(base_tokenizer)
    (ids, mask, truncated), = encode_many(tok, [CONVERSATION], 10)
    assert truncated and len(ids) == len(mask) == 10


def test_unalignable_template_is_a_one_line_error(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    # The header depends on the assistant text, so the placeholder render cannot be lined up with the real one.
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{{ m.content|length }}:{{ m.content }}"
        "{% else %}<|user|>{{ m.content }}{% endif %}<|eot|>{% endfor %}"
    )
    rows = [CONVERSATION[1:3], CONVERSATION[1:3]]
    with pytest.raises(UserError) as err:
        encode_many(tok, rows, 512, row_ids=[41, 42])
    message = str(err.value)
    assert "row 41" in message and "data.chat_template" in message and len(message.splitlines()) == 1


def test_no_chat_template_is_a_one_line_error(base_tokenizer):
    from mtp_train.data.chat_mask import require_template

    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = None
    for call in (lambda: require_template(tok, "target"), lambda: encode_many(tok, [CONVERSATION], 512)):
        with pytest.raises(UserError) as err:
            call()
        assert "data.chat_template" in str(err.value) and len(str(err.value).splitlines()) == 1
    assert encode_many(tok, ["text rows need no template"], 512)[0][1][0] == 0
