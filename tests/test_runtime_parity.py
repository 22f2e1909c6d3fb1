"""Exact parity of the runtime with transformers, for every family, in prefill and in paged decode."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET
from hf_models import FAMILY_OPTIONS, save_random_model
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sequence import Sequence
from mtp_train.runtime.sampling import SamplingParams

pytestmark = pytest.mark.parity
FAMILIES = sorted(FAMILY_OPTIONS)
TOL = 1e-4


def random_sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def new_sequence() -> Sequence:
    return Sequence(0, [], SamplingParams(), frozenset(), 0)


def forward_new(engine: Engine, scheduled: list[tuple[Sequence, list[int]]]):
    """Reserve pages for the sequences' new tokens, then forward them."""
    engine.reserve(scheduled)
    return engine.forward(scheduled)


def prefill_logits(engine: Engine, seqs: list[list[int]]) -> list[torch.Tensor]:
    """All sequences in one packed prefill; logits ``[len, vocab]`` per sequence."""
    handles = [new_sequence() for _ in seqs]
    meta, hidden, _ = forward_new(engine, list(zip(handles, seqs)))
    logits = engine.model.logits(hidden)
    for h in handles:
        engine.release(h)
    cu = meta.qo_indptr.tolist()
    return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]


def decode_logits(engine: Engine, tokens: list[int], prefill: int, step: int = 1) -> torch.Tensor:
    """Prefill ``tokens[:prefill]``, then feed the rest ``step`` tokens at a time through the pages.

    ``step == 1`` is plain decoding; ``step == k + 1`` is the shape of a speculative verify batch.
    """
    seq = new_sequence()
    _, hidden, _ = forward_new(engine, [(seq, tokens[:prefill])])
    rows = [engine.model.logits(hidden[-1:])]
    for i in range(prefill, len(tokens), step):
        _, hidden, _ = forward_new(engine, [(seq, tokens[i : i + step])])
        rows.append(engine.model.logits(hidden))
    engine.release(seq)
    return torch.cat(rows)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = save_random_model(request.param, root)
    return request.param, root, model


def test_prefill_matches_transformers(family_model):
    family, root, model = family_model
    engine = Engine.from_pretrained(root, page_size=16)
    seqs = random_sequences(model.config.vocab_size, [1, 9, 40])
    for seq, ours in zip(seqs, prefill_logits(engine, seqs)):
        assert_close(ours, hf_logits(model, seq))


def test_paged_decode_matches_transformers(family_model):
    family, root, model = family_model
    engine = Engine.from_pretrained(root, page_size=4)
    (tokens,) = random_sequences(model.config.vocab_size, [30], seed=1)
    assert_close(decode_logits(engine, tokens, prefill=5), hf_logits(model, tokens)[4:])


def test_verify_batches_match_transformers(family_model):
    family, root, model = family_model
    engine = Engine.from_pretrained(root, page_size=4)
    (tokens,) = random_sequences(model.config.vocab_size, [29], seed=2)
    assert_close(decode_logits(engine, tokens, prefill=5, step=4), hf_logits(model, tokens)[4:])


def test_mixed_step_matches_transformers(family_model):
    """One forward holding decodes, a fresh prefill and a verify, in an order that interleaves them."""
    family, root, model = family_model
    engine = Engine.from_pretrained(root, page_size=4)
    seqs = random_sequences(model.config.vocab_size, [20, 12, 25, 17], seed=3)
    cached = [19, 0, 22, 16]  # decode, fresh prefill, verify of 3, decode
    handles = [new_sequence() for _ in seqs]
    for h, tokens, n in zip(handles, seqs, cached):
        if n:
            forward_new(engine, [(h, tokens[:n])])
    meta, hidden, _ = forward_new(engine, [(h, tokens[n:]) for h, tokens, n in zip(handles, seqs, cached)])
    logits = engine.model.logits(hidden)
    cu = meta.qo_indptr.tolist()
    for i, (tokens, n) in enumerate(zip(seqs, cached)):
        assert_close(logits[cu[i] : cu[i + 1]], hf_logits(model, tokens)[n:])


def test_decodes_of_far_apart_lengths_attend_in_separate_groups_and_match_transformers(family_model):
    """Decodes with 3 to 90 cached tokens: padded together, the short ones would read 90 keys; they are split into
    runs of similar length, each its own SDPA call, and every row still matches transformers."""
    from mtp_train.runtime.attention import _similar_lengths

    family, root, model = family_model
    engine = Engine.from_pretrained(root, page_size=4)
    cached = [3, 90, 5, 70, 4]
    assert _similar_lengths(list(range(5)), [n + 1 for n in cached]) == [[0, 2, 4], [1, 3]]
    seqs = random_sequences(model.config.vocab_size, [n + 1 for n in cached], seed=4)
    handles = [new_sequence() for _ in seqs]
    for h, tokens, n in zip(handles, seqs, cached):
        forward_new(engine, [(h, tokens[:n])])
    meta, hidden, _ = forward_new(engine, [(h, tokens[n:]) for h, tokens, n in zip(handles, seqs, cached)])
    logits = engine.model.logits(hidden)
    for i, (tokens, n) in enumerate(zip(seqs, cached)):
        assert_close(logits[i : i + 1], hf_logits(model, tokens)[n:])


def test_sliding_window_is_exercised(tmp_path):
    """The runtime reads the mistral checkpoint's window, and the window is in force within the decode test's 30
    tokens: against the same weights without a window, its logits are the same up to the window and differ at
    every position past it."""
    model = save_random_model("mistral", tmp_path / "window")
    save_random_model("mistral", tmp_path / "full", sliding_window=None)
    engine = Engine.from_pretrained(tmp_path / "window", page_size=4)
    window = engine.cfg.sliding_window
    assert window == model.config.sliding_window and 5 < window < 30
    (tokens,) = random_sequences(model.config.vocab_size, [30], seed=1)
    ours = decode_logits(engine, tokens, prefill=5)  # rows are positions 4..29
    full = decode_logits(Engine.from_pretrained(tmp_path / "full", page_size=4), tokens, prefill=5)
    assert_close(ours[: window - 4], full[: window - 4])
    assert (ours[window - 4 :] - full[window - 4 :]).abs().amax(-1).min() > 1e-3


def test_tied_embeddings_and_sharded_index(tmp_path):
    model = save_random_model("qwen2", tmp_path, tie_word_embeddings=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not any("lm_head" in k for k in model.state_dict().keys() if k in _saved_keys(tmp_path))
    engine = Engine.from_pretrained(tmp_path)
    assert engine.model.output.weight.data_ptr() == engine.model.tok_embeddings.weight.data_ptr()
    (tokens,) = random_sequences(256, [20], seed=2)
    assert_close(prefill_logits(engine, [tokens])[0], hf_logits(model, tokens))


def _saved_keys(root) -> set[str]:
    import json

    return set(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"])


def test_tiny_target_prefill_and_decode_match_transformers():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(TINY_TARGET, page_size=16)
    seqs = random_sequences(model.config.vocab_size, [3, 50, 120], seed=3)
    for seq, ours in zip(seqs, prefill_logits(engine, seqs)):
        assert_close(ours, hf_logits(model, seq))
    assert_close(decode_logits(engine, seqs[2], prefill=100), hf_logits(model, seqs[2])[99:])
