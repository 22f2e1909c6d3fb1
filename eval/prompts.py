"""The eval prompt sets: held-out training rows and four public benchmarks, as chat messages.

Sets (``PROMPT_SETS``), their ids and categories:

| set | source | ``prompt_id`` | ``category`` | messages |
|---|---|---|---|---|
| ``heldout`` | the training rows the seeded draw set aside | ``heldout/row-<row id>`` | ``heldout`` | see below |
| ``spec_bench`` | ``data/eval/spec_bench/question.jsonl`` | ``spec_bench/<question_id>`` | its 13 categories | first turn |
| ``mt_bench`` | ``data/eval/mt_bench/question.jsonl`` | ``mt_bench/<question_id>`` | its 8 categories | first turn |
| ``humaneval`` | ``data/eval/humaneval/HumanEval.jsonl.gz`` | ``humaneval/<n>`` (from ``HumanEval/<n>``) | ``code`` | see below |
| ``gsm8k`` | ``data/eval/gsm8k/test.jsonl`` | ``gsm8k/<line index>`` | ``math`` | the question |
| ``sgd_dev`` | ``data/sgd/sgd_dev_sharegpt.jsonl.gz`` (SGD's dev split) | ``sgd_dev/<line index>`` | first service, e.g. ``Restaurants`` | cut as held-out rows are |
| ``long`` | ``data/long/eval.jsonl.gz`` (retrieved passages and a question) | ``long/<line index>`` | its size: ``1k`` ... ``8k`` | the user turn |

**Held-out prompts.** Each held-out chat row is cut just after one of its user turns that an assistant turn
follows (the candidates), chosen uniformly with a seed derived from the row id alone, so ``heldout/row-N`` is the
same prompt in every run whatever the recipe's seed. The prompt is every message up to and including that user
turn (system turn, earlier user and assistant turns), so the context is in-domain and usually several turns deep.
Not always the last user turn: in SGD the final exchange is nearly always a sign-off ("That's all, thanks." ->
"Have a great day.", 4.5 words on average against 11 for all replies), which would measure the head on one
formulaic reply; a uniform pick is distributed over reply positions as the training tokens are, and spreads
the prompts over context lengths. ``render_prompt`` of such a prompt is token for token a prefix of the
training encoding of the whole row (``mtp_train.data.dataset.encode``). Plain-text rows (format ``text``) have no
turns and are skipped, as are rows with no user turn before an assistant turn.

**SGD dev** is the in-domain set for heads trained on the SGD example data: dialogues of SGD's dev split, which
no training file holds, each cut as a held-out row is (the seed is ``sgd_dev/<line index>``), so it measures
any head on the same in-domain prompts whatever its training data.

**HumanEval** is not a chat set; its function stub goes into one user turn as
``Complete the following Python function.\\n\\n```python\\n<stub>```\\n``. Reference answers, tests and
second turns in the files are never read.

**Subsets.** ``max_prompts=N`` takes a deterministic, category-stratified subset: each category's prompts are
shuffled with a seed derived from ``(seed, set, category)`` and then dealt round-robin over the categories in
sorted order until N are taken, so a small eval still covers every category and the first n of the list are
themselves the subset for n. Without ``max_prompts`` the set comes whole, in file (or row-id) order.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.recipe_types import PROMPT_SETS  # the recipe's eval.prompt_sets choices are these sets

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "eval"
FILES = {
    "spec_bench": "spec_bench/question.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
    "humaneval": "humaneval/HumanEval.jsonl.gz",
    "gsm8k": "gsm8k/test.jsonl",
    "sgd_dev": "../sgd/sgd_dev_sharegpt.jsonl.gz",
    "long": "../long/eval.jsonl.gz",
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{stub}```\n"


@dataclass(frozen=True)
class EvalPrompt:
    """One eval prompt: chat messages up to and including the user turn the model answers."""

    set_name: str  # one of PROMPT_SETS
    prompt_id: str  # stable across runs, e.g. "spec_bench/81" or "heldout/row-1234"
    category: str  # Spec-Bench/MT-bench category; "code" (humaneval); "math" (gsm8k); "heldout"; SGD service
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": ...}], ends with a user turn


def _valid() -> str:
    return ", ".join(PROMPT_SETS)


def load_prompt_set(
    name: str,
    *,
    data_dir: Path | None = None,
    heldout_rows: Sequence[Any] | None = None,
    heldout_ids: Iterable[int] | None = None,
    max_prompts: int | None = None,
    seed: int = 0,
) -> list[EvalPrompt]:
    """The prompts of set ``name``; see the module docstring for ids, categories and the subset rule.

    Args:
        name: one of ``PROMPT_SETS``.
        data_dir: folder holding the benchmark files (default: the repo's ``data/eval``).
        heldout_rows: for ``heldout`` only: the training rows, as ``mtp_train.data.dataset.load_rows(...).rows``
            (``Row`` objects, whose ``row_id`` is matched against ``heldout_ids``), or raw rows (ShareGPT /
            OpenAI / prompt-completion dicts, or message lists), whose id is their index in this list.
        heldout_ids: for ``heldout``: the held-out row ids (``manifest.heldout_row_ids``); ``None`` takes every
            row passed. An id with no row is an error.
        max_prompts: take a category-stratified subset of at most this many prompts; ``None`` takes all.
        seed: seed of the subset draw.

    Raises:
        UserError: unknown set, missing or unreadable file, missing held-out rows, or an empty set.
    """
    if name not in PROMPT_SETS:
        raise UserError(f"eval.prompt_sets: unknown prompt set {name!r}; valid sets are {_valid()}")
    if max_prompts is not None and max_prompts < 1:
        raise UserError(f"eval.max_prompts: must be at least 1 (got {max_prompts})")
    if name == "heldout":
        prompts = _heldout(heldout_rows, heldout_ids)
    else:
        path = Path(data_dir if data_dir is not None else DATA_DIR) / FILES[name]
        if not path.is_file():
            raise UserError(f"prompt set {name!r}: {path} not found (valid sets are {_valid()})")
        records = _read_jsonl(path, name)
        prompts = [p for i, rec in enumerate(records) if (p := _BUILDERS[name](i, rec, path)) is not None]
    if not prompts:
        raise UserError(f"prompt set {name!r}: no prompts")
    return prompts if max_prompts is None else stratified_subset(prompts, max_prompts, seed)


def stratified_subset(prompts: list[EvalPrompt], n: int, seed: int) -> list[EvalPrompt]:
    """At most ``n`` prompts dealt round-robin over the sorted categories, each category shuffled with its own seed."""
    by_cat: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    queues = []
    for cat in sorted(by_cat):
        items = list(by_cat[cat])
        # A string seed is hashed with SHA-512 by `random`, so the draw is the same in every process.
        random.Random(f"{seed}/{prompts[0].set_name}/{cat}").shuffle(items)
        queues.append(items)
    out: list[EvalPrompt] = []
    depth = 0
    while len(out) < n and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out) < n:
                out.append(q[depth])
        depth += 1
    return out


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ending with the assistant header.

    The same call as precompute's ``encode`` (``apply_chat_template(tokenize=True)``: the template supplies BOS,
    nothing is added on top) plus ``add_generation_prompt=True``, so a held-out prompt renders as an exact
    prefix of its row's training tokens.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{getattr(tokenizer, 'name_or_path', 'tokenizer')}: has no chat template to render prompts with")
    try:
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as e:  # jinja raises TemplateError for unsupported roles and the like
        raise UserError(f"{getattr(tokenizer, 'name_or_path', 'tokenizer')}: chat template failed on a prompt: "
                        f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
    return list(enc["input_ids"])


# --- the benchmark files ---------------------------------------------------------------------------------


def _read_jsonl(path: Path, name: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError(f"line {lineno} is not a JSON object")
                    records.append(rec)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"prompt set {name!r}: {path} cannot be read: {str(e).splitlines()[0][:200]}") from None
    return records


def _field(rec: dict[str, Any], key: str, kind: type, path: Path, index: int) -> Any:
    value = rec.get(key)
    if not isinstance(value, kind) or (isinstance(value, (str, list)) and not value):
        raise UserError(f"{path}: record {index} has no usable {key!r}")
    return value


def _question_set(set_name: str):
    def build(i: int, rec: dict[str, Any], path: Path) -> EvalPrompt:
        turns = _field(rec, "turns", list, path, i)
        if not isinstance(turns[0], str):
            raise UserError(f"{path}: record {i} has a non-string first turn")
        qid = rec.get("question_id", i)
        category = rec.get("category")
        return EvalPrompt(set_name, f"{set_name}/{qid}", category if isinstance(category, str) else "none",
                          [{"role": "user", "content": turns[0]}])

    return build


def _humaneval(i: int, rec: dict[str, Any], path: Path) -> EvalPrompt:
    stub = _field(rec, "prompt", str, path, i)
    task = rec.get("task_id")
    suffix = task.split("/", 1)[1] if isinstance(task, str) and "/" in task else str(i)
    return EvalPrompt("humaneval", f"humaneval/{suffix}", "code",
                      [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(stub=stub)}])


def _gsm8k(i: int, rec: dict[str, Any], path: Path) -> EvalPrompt:
    question = _field(rec, "question", str, path, i)
    return EvalPrompt("gsm8k", f"gsm8k/{i}", "math", [{"role": "user", "content": question}])


def _sgd_dev(i: int, rec: dict[str, Any], path: Path) -> EvalPrompt | None:
    messages = _row_messages(rec)
    context = heldout_context(messages, f"sgd_dev/{i}") if messages else None
    if context is None:
        return None
    services = rec.get("services")
    service = services[0] if isinstance(services, list) and services and isinstance(services[0], str) else "none"
    return EvalPrompt("sgd_dev", f"sgd_dev/{i}", service.split("_")[0], context)


def _long(i: int, rec: dict[str, Any], path: Path) -> EvalPrompt:
    messages = _field(rec, "messages", list, path, i)
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages) \
            or messages[-1].get("role") != "user":
        raise UserError(f"{path}: record {i}'s messages are not chat turns ending with a user turn")
    return EvalPrompt("long", f"long/{i}", _field(rec, "category", str, path, i), messages)


_BUILDERS = {
    "spec_bench": _question_set("spec_bench"),
    "mt_bench": _question_set("mt_bench"),
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
    "sgd_dev": _sgd_dev,
    "long": _long,
}


# --- held-out rows ---------------------------------------------------------------------------------------


def heldout_cuts(messages: list[dict[str, str]]) -> list[int]:
    """Indices of the user turns that an assistant turn follows (later, with no user turn in between)."""
    cuts, last_user = [], None
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            last_user = i
        elif m.get("role") == "assistant" and last_user is not None and (not cuts or cuts[-1] != last_user):
            cuts.append(last_user)
    return cuts


def heldout_context(messages: list[dict[str, str]], seed: str) -> list[dict[str, str]] | None:
    """Messages up to and including the user turn drawn with ``seed`` (``heldout/row-<row id>`` for a held-out
    row); None if the row has no candidate."""
    cuts = heldout_cuts(messages)
    if not cuts:
        return None
    cut = random.Random(seed).choice(cuts)
    return [{"role": m["role"], "content": m["content"]} for m in messages[: cut + 1]]


def _row_messages(content: Any) -> list[dict[str, str]] | None:
    """Chat messages of a row's content, or None for plain text."""
    from mtp_train.data.formats import BadRow, detect_format, to_messages

    if isinstance(content, str):
        return None
    if isinstance(content, list):
        return content
    if isinstance(content, dict):
        fmt = detect_format(list(content))
        if fmt is None or fmt == "text":
            return None
        try:
            out = to_messages(content, fmt)
        except BadRow:
            return None
        return out if isinstance(out, list) else None
    raise TypeError(f"unsupported held-out row content: {type(content).__name__}")


def _heldout(rows: Sequence[Any] | None, ids: Iterable[int] | None) -> list[EvalPrompt]:
    if rows is None:
        raise UserError("prompt set 'heldout': needs the training rows and the held-out row ids (run precompute first)")
    by_id: dict[int, Any] = {}
    for index, row in enumerate(rows):
        row_id = getattr(row, "row_id", index)
        by_id[int(row_id)] = getattr(row, "content", row)
    wanted = sorted(by_id) if ids is None else sorted({int(i) for i in ids})
    missing = [i for i in wanted if i not in by_id]
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise UserError(f"prompt set 'heldout': {len(missing)} held-out row id(s) are not in the data ({shown}); "
                        "the data files changed since precompute")
    out = []
    for row_id in wanted:
        messages = _row_messages(by_id[row_id])
        context = heldout_context(messages, f"heldout/row-{row_id}") if messages else None
        if context is not None:
            out.append(EvalPrompt("heldout", f"heldout/row-{row_id}", "heldout", context))
    if wanted and not out:
        raise UserError("prompt set 'heldout': none of the held-out rows is a chat with a user turn before an "
                        "assistant turn (plain-text data has no prompts to evaluate)")
    return out
