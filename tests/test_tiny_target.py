"""The tiny default target: HF format, offline-loadable, masked chat template, quality bar, fixed greedy output."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_TARGET, greedy_distinct2, hf_model, hf_tokenizer

QUALITY = json.loads((TINY_TARGET / "quality.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return hf_tokenizer(TINY_TARGET)


@pytest.fixture(scope="module")
def model():
    return hf_model(TINY_TARGET)


def test_ships_the_hf_files_within_25_mb():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (TINY_TARGET / name).is_file(), name
    total = sum(f.stat().st_size for f in TINY_TARGET.iterdir())
    assert total <= 25 * 2**20, f"{total / 2**20:.1f} MiB"


def test_is_a_small_llama(model):
    assert model.config.model_type == "llama"
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= params <= 5_000_000
    assert params == QUALITY["parameters"]


def test_tokenizer_is_a_byte_level_bpe_of_about_4096(tokenizer):
    assert 4000 <= len(tokenizer) <= 4200
    text = "Book a table at 71 Saint Peter for 2 at 11:30 am — merci!"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_masks_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "user", "content": "I want to eat in San Jose."},
        {"role": "assistant", "content": "What kind of food do you like?"},
        {"role": "user", "content": "Mexican."},
        {"role": "assistant", "content": "I found 3 restaurants."},
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert masked == "What kind of food do you like?<|eot|>I found 3 restaurants.<|eot|>"
    assert ids[0] == tokenizer.bos_token_id and mask[0] == 0


def test_quality_bar_measured_on_the_sgd_dev_split(model, tokenizer):
    """Measured here with the training script's own functions: the next-token loss on the first 32 windows of 256
    tokens of the dev split, and distinct-2 of greedy continuations of the script's 50 dev prompts (batched)."""
    from mtp_train.tools.tiny_target import dev_loss, encode_dialogues, pack, read_sgd

    dev = read_sgd("dev")
    windows = pack(encode_dialogues(tokenizer, dev[:60]), 256)[:32]
    assert windows.shape[0] == 32
    assert dev_loss(model, windows, batch_size=32) <= 2.4
    model.eval()  # dev_loss leaves the model in train mode
    assert greedy_distinct2(model, tokenizer, QUALITY["seed"]) >= 0.15


def test_greedy_output_equals_the_stored_expectation(model, tokenizer):
    """Loading through transformers offline reproduces the script's greedy replies token for token; each is a
    reply of a few words that does not loop."""
    import torch

    from mtp_train.tools.tiny_target import max_repeat_fraction

    for item in QUALITY["fixed_prompts"]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=len(item["greedy_ids"]), pad_token_id=tokenizer.pad_token_id,
            )
        reply = out[0, ids.shape[1]:].tolist()
        assert reply == item["greedy_ids"]
        assert max_repeat_fraction(reply) < 0.2, item["prompt"]  # no loop
        assert len(tokenizer.decode(reply, skip_special_tokens=True).split()) >= 3, item["prompt"]
