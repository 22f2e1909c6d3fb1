"""Speculative decoding in the runtime: lossless in both modes, at any batch, k and page pressure."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import TINY_TARGET, sgd_chat_prompts
from hf_models import save_random_model
from mtp_train.models.checkpoint import load_transformer
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.drafters import DraftModelDrafter, HeadDrafter, head_drafter
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.train.checkpoint import load_head

GREEDY = SamplingParams(max_new_tokens=12, stop_token_ids=())
PRESSURE_PAGES = 40  # 640 target slots (and as many draft slots) for 8 sequences of up to ~150 tokens: preemptions


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """16 chat prompts of different lengths from the SGD dev split."""
    return sgd_chat_prompts(16, 4)


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return [r.tokens for r in Engine.from_pretrained(TINY_TARGET).generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (another family than the Llama target) with the target's vocabulary."""
    root = tmp_path_factory.mktemp("draft")
    save_random_model("qwen2", root, vocab_size=4096, hidden_size=64, num_hidden_layers=1, max_position_embeddings=2048)
    return root


def decode(prompts, make_drafter, k: int, max_seqs: int, num_pages: int | None = None, params=GREEDY):
    engine = Engine.from_pretrained(TINY_TARGET, page_size=16, num_pages=num_pages, max_seqs=max_seqs)
    decoder = SpeculativeDecoder(engine, make_drafter(engine), k)
    out = decoder.generate(prompts, params)
    assert engine.allocator.num_free == engine.allocator.num_pages, "every page is returned"
    draft_pages = decoder.drafter.allocator
    assert draft_pages.num_free == draft_pages.num_pages, "every draft page is returned"
    assert decoder.greedy_violations == 0, "every emitted greedy token is the verify forward's own argmax"
    return out


CASES = [(k, max_seqs, pages) for k in (1, 2, 3, 4) for max_seqs, pages in ((1, None), (8, PRESSURE_PAGES))]


@pytest.mark.slow
@pytest.mark.parametrize("k,max_seqs,pages", CASES)
def test_draft_target_greedy_is_lossless(prompts, reference, random_draft, k, max_seqs, pages):
    out = decode(prompts, lambda e: DraftModelDrafter(e, load_transformer(random_draft)), k, max_seqs, pages)
    assert [r.tokens for r in out] == reference
    if pages:
        assert sum(r.stats.preemptions for r in out) > 0, "the case is meant to run under page pressure"


@pytest.mark.slow
@pytest.mark.parametrize("k,max_seqs,pages", CASES)
def test_mtp_greedy_is_lossless_with_a_trained_head(prompts, reference, trained_run, k, max_seqs, pages):
    head = load_head(trained_run.parent / "run" / "heads" / "mtp")
    out = decode(prompts, lambda e: HeadDrafter(e, head), k, max_seqs, pages)
    assert [r.tokens for r in out] == reference
    accepted = [a for r in out for a in r.stats.accepted]
    assert sum(accepted) > 0, "a trained head has some drafts accepted"
    if pages:
        assert sum(r.stats.preemptions for r in out) > 0


@pytest.mark.parametrize("kind,k,max_seqs,pages", [
    (kind, *c) if c == (3, 8, PRESSURE_PAGES) else pytest.param(kind, *c, marks=pytest.mark.slow)
    for kind in ("eagle3", "dflash") for c in CASES] + [("peagle", 4, 8, PRESSURE_PAGES), ("peagle", 2, 1, None)])
def test_aux_layer_heads_are_lossless_greedy(prompts, reference, request, kind, k, max_seqs, pages):
    """An eagle3 head drafts a chain from its 1,024-id vocabulary over three target layers' states; a dflash head
    drafts a block over the same layers, its context in the draft's pages (truncated and rewritten on preemption); a
    P-EAGLE head drafts k in one causal forward over its kept rows and k - 1 masks."""
    run = request.getfixturevalue(f"{kind}_run")
    head = load_head(run.parent / "run" / "heads" / ("eagle3" if kind == "peagle" else kind))
    out = decode(prompts, lambda e: head_drafter(e, head), k, max_seqs, pages)
    assert [r.tokens for r in out] == reference
    assert sum(a for r in out for a in r.stats.accepted) > 0, "a trained head has some drafts accepted"
    if pages:
        assert sum(r.stats.preemptions for r in out) > 0


@pytest.mark.parametrize("k", [1, 3])
def test_an_identical_draft_is_always_accepted(prompts, reference, k):
    """The target as its own draft: every step accepts all k drafts, so tau = k + 1 (bonus included)."""
    out = decode(prompts[:4], lambda e: DraftModelDrafter(e, load_transformer(TINY_TARGET)), k, 4)
    assert [r.tokens for r in out] == reference[:4]
    for r in out:
        # Every step but the last emits k + 1; the last is cut by max_new_tokens.
        assert all(a == k and e == k + 1 for a, e in zip(r.stats.accepted[:-1], r.stats.emitted[:-1]))
        assert 1 + sum(r.stats.emitted) == GREEDY.max_new_tokens  # (+1: the prefill step's token)


def test_a_useless_draft_still_gives_the_correct_output(prompts, reference):
    """A draft that never agrees (random weights): almost nothing is accepted, and the output is unchanged."""
    out = decode(prompts[:4], lambda e: HeadDrafter(e, _random_head(e)), 3, 4)
    assert [r.tokens for r in out] == reference[:4]
    steps = [e for r in out for e in r.stats.emitted]
    assert sum(steps) / len(steps) < 1.2


def _random_head(engine, kind: str = "mtp"):
    from mtp_train.heads import build_head, head_spec

    torch.manual_seed(0)
    return build_head(head_spec(kind, 1, engine.cfg, "random"))


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_a_head_drafter_is_named_after_its_head_kind(kind):
    engine = Engine.from_pretrained(TINY_TARGET)
    assert HeadDrafter(engine, _random_head(engine, kind)).name == kind


@pytest.mark.parametrize("draft", ["draft_target", "eagle3", "dflash"])
def test_sampling_distribution_equals_the_target(random_draft, request, draft):
    """At temperature 1, the second and third generated tokens (both speculative) follow the target's
    distribution: chi-square of speculative against plain sampling over 600 seeds each. The eagle3 head drafts
    from a reduced vocabulary, so the residual distribution also covers the ids it cannot draft; the dflash head
    draws its block's drafts independently, each from its own position's distribution."""
    prompt = [0, 5, 300, 301, 302, 6]
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(), seed=s) for s in range(600)]
    plain = Engine.from_pretrained(TINY_TARGET, max_seqs=64).generate([prompt] * 600, params)
    if draft == "draft_target":
        make = lambda e: DraftModelDrafter(e, load_transformer(random_draft))  # noqa: E731
    else:
        run = request.getfixturevalue(f"{draft}_run")
        make = lambda e: head_drafter(e, load_head(run.parent / "run" / "heads" / draft))  # noqa: E731
    spec = decode([prompt] * 600, make, 2, 64, params=params)
    for position in (1, 2):
        chi2, critical = chi_square_two_samples([r.tokens[position] for r in plain], [r.tokens[position] for r in spec])
        assert chi2 < critical, (position, chi2, critical)


def chi_square_two_samples(a_tokens: list[int], b_tokens: list[int]) -> tuple[float, float]:
    """Pearson's chi-square of two equal-size samples of tokens (tokens seen fewer than 20 times pooled) and its
    critical value at p = 0.001 (Wilson-Hilferty approximation)."""
    a, b = Counter(a_tokens), Counter(b_tokens)
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 20]
    cells = [(a[t], b[t]) for t in common] + [(len(a_tokens) - sum(a[t] for t in common),
                                               len(b_tokens) - sum(b[t] for t in common))]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y)
    dof = len(cells) - 1
    return chi2, dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


def test_a_broken_acceptance_rule_is_counted_as_greedy_violations(prompts, monkeypatch):
    """The check behind ``greedy_violations`` can fail: a rule that accepts every draft is caught."""
    import mtp_train.runtime.speculative as spec

    monkeypatch.setattr(spec, "accept_greedy", lambda drafts, own, lens: (lens, own.gather(1, lens[:, None])[:, 0]))
    engine = Engine.from_pretrained(TINY_TARGET, page_size=16, max_seqs=4)
    decoder = SpeculativeDecoder(engine, HeadDrafter(engine, _random_head(engine)), 3)
    decoder.generate(prompts[:4], GREEDY)
    assert decoder.greedy_violations > 0


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_vocabulary_keeps_decoding_lossless(prompts, reference, trained_run, k):
    """eval.draft_vocab: the head drafts from 512 ids only (rows of the frozen lm_head), never outside them, and
    greedy decoding is unchanged."""
    head = load_head(trained_run.parent / "run" / "heads" / "mtp")
    vocab = torch.arange(0, 4096, 8)  # 512 ids
    seen: list[int] = []

    class Watched(HeadDrafter):
        def logits(self, out):
            logits = super().logits(out)
            seen.extend(logits.argmax(-1).tolist())
            return logits

    def drafter(engine):
        d = Watched(engine, head, vocab=vocab)
        x = torch.randn(3, engine.cfg.hidden_size)
        restricted = d.logits(x)
        assert torch.isinf(restricted[:, [1, 2, 3]]).all(), "ids outside the vocabulary get probability 0"
        assert torch.allclose(restricted[:, vocab], HeadDrafter(engine, head).logits(x)[:, vocab], atol=1e-5), "rows"
        seen.clear()
        return d

    out = decode(prompts[:8], drafter, k, 8)
    assert [r.tokens for r in out] == reference[:8]
    assert seen and set(seen) <= set(vocab.tolist())


def test_the_draft_vocabulary_is_the_most_frequent_assistant_tokens(trained_run):
    from mtp_train.eval.loading import draft_vocab
    from mtp_train.recipe import load_recipe
    from mtp_train.features.reader import FeatureReader

    recipe = load_recipe(trained_run, [f"eval.draft_vocab={64}"])
    vocab = draft_vocab(recipe, 4096)
    assert vocab.shape == (64,) and torch.equal(vocab, vocab.sort().values)
    reader = FeatureReader(recipe.features_dir)
    counts = Counter()
    for ref in reader.train:
        rows = reader.load(ref)
        counts.update(rows["input_ids"][rows["loss_mask"].bool()].tolist())
    kth = sorted(counts.values(), reverse=True)[63]
    assert all(counts[t] >= kth for t in vocab.tolist())
    assert draft_vocab(load_recipe(trained_run, []), 4096) is None
