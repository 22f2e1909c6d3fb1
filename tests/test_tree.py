"""Tree drafting: the acceptance rule preserves the target's distribution, a tree of topk 1 is the chain step for
step, and decoding with a tree is lossless for every draft kind, under page pressure and preemption."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET
from mtp_train.models.checkpoint import load_transformer
from mtp_train.runtime.drafters import BigramDrafter, DraftModelDrafter, head_drafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.runtime.tree import TreeShape, accept_tree, build_tree, path_of
from mtp_train.runtime.tree_decoder import TreeDecoder
from mtp_train.train.checkpoint import load_head
from test_acceptance import CHI2_CRITICAL_P001, DRAFTS, T, V, chi_square
from test_speculative import GREEDY, PRESSURE_PAGES, decode, prompts, random_draft, reference  # noqa: F401

TRIALS = 3000
SHAPE = TreeShape(topk=3, depth=2, draft_tokens=5)  # 3 children of the root, 9 grandchildren, 4 of 12 kept


def _toy_step(root: torch.Tensor, draft: torch.Tensor, gen: torch.Generator, honest: bool = True) -> list[list[int]]:
    """One tree step of B toy sequences whose last tokens are ``root [B]``: target and draft are first-order Markov
    chains (``T`` and ``draft``, both ``[V, V]``), so each node's distributions depend on its token alone.
    ``honest=False`` tells the rule the draft drew from the target (a broken rule, the negative control)."""
    batch = root.shape[0]
    params = [SamplingParams(temperature=1.0)] * batch
    u = torch.rand((batch, SHAPE.uniforms), generator=gen, dtype=torch.float64)
    logq = draft.log().float()
    tree = build_tree(root, logq[root], lambda level, tokens, *_: logq[tokens], SHAPE, params, u)
    p = T[tree.tokens].float()  # [B, N, V]: the target after each node
    if not honest:
        tree.q = p
    m, n = SHAPE.candidates, SHAPE.draft_tokens
    accepted, token, leaf = accept_tree(tree, SHAPE.depth, p, torch.full((batch,), SHAPE.depth), u[:, m : m + n - 1],
                                        u[:, m + n - 1])
    drafts = tree.tokens.gather(1, path_of(tree, leaf, SHAPE.depth))[:, 1:]
    return [drafts[b, : accepted[b]].tolist() + [int(token[b])] for b in range(batch)]


def _pair_counts(draft: torch.Tensor, honest: bool = True) -> torch.Tensor:
    """Counts of the first two tokens emitted after token 0 over ``TRIALS`` sequences, two tree steps each."""
    gen = torch.Generator().manual_seed(7)
    out = _toy_step(torch.zeros(TRIALS, dtype=torch.int64), draft, gen, honest)
    second = _toy_step(torch.tensor([o[-1] for o in out]), draft, gen, honest)
    counts = torch.zeros(V * V, dtype=torch.float64)
    for a, b in zip(out, second):
        first_two = (a + b)[:2]
        counts[first_two[0] * V + first_two[1]] += 1
    return counts


@pytest.mark.parametrize("draft", ["bad", "good"])
def test_tree_acceptance_keeps_the_targets_distribution(draft):
    """Over 3,000 sequences, the first two emitted tokens follow the target (chi-square, p = 0.001), with children
    drawn without replacement, pruned by score and tried in draw order."""
    pairs = (T[0][:, None] * T).reshape(-1)  # P(a, b) = T[0][a] T[a][b]
    assert chi_square(_pair_counts(DRAFTS[draft][1]), pairs) < CHI2_CRITICAL_P001[24]


def test_the_tree_chi_square_catches_a_broken_rule():
    """The negative control: a rule that takes the draft's distribution for the target's emits the draft's."""
    pairs = (T[0][:, None] * T).reshape(-1)
    assert chi_square(_pair_counts(DRAFTS["bad"][1], honest=False), pairs) > CHI2_CRITICAL_P001[24]


def test_a_tree_shape_names_its_bounds():
    assert TreeShape(4, 4, 8).candidates == 4 + 3 * 16 and TreeShape(4, 4, 8).expanded == 13
    with pytest.raises(ValueError, match="2..5 draft tokens"):
        TreeShape(1, 4, 6)


def _head(request, kind: str):
    run = request.getfixturevalue("trained_run" if kind == "mtp" else f"{kind}_run")
    return load_head(run.parent / "run" / "heads" / kind)


def _tree_decode(prompts, make_drafter, shape: TreeShape, max_seqs: int, num_pages: int | None = None,  # noqa: F811
                 params=GREEDY):
    engine = Engine.from_pretrained(TINY_TARGET, page_size=16, num_pages=num_pages, max_seqs=max_seqs)
    decoder = TreeDecoder(engine, make_drafter(engine), shape)
    out = decoder.generate(prompts, params)
    assert engine.allocator.num_free == engine.allocator.num_pages, "every page is returned"
    assert decoder.drafter.allocator.num_free == decoder.drafter.allocator.num_pages, "every draft page is returned"
    assert decoder.greedy_violations == 0
    return out


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_of_topk_1_is_the_chain_step_for_step(prompts, request, kind, temperature):  # noqa: F811
    """The same drafts, uniform for uniform: every request's accepted counts and tokens equal the chain's at k = 3."""
    head = _head(request, kind)
    params = [SamplingParams(temperature=temperature, max_new_tokens=16, stop_token_ids=(), seed=i) for i in range(8)]
    chain = decode(prompts[:8], lambda e: head_drafter(e, head), 3, 8, params=params)
    tree = _tree_decode(prompts[:8], lambda e: head_drafter(e, head), TreeShape(1, 3, 4), 8, params=params)
    assert [r.stats.accepted for r in tree] == [r.stats.accepted for r in chain]
    assert [r.tokens for r in tree] == [r.tokens for r in chain]
    assert sum(a for r in chain for a in r.stats.accepted) > 0


@pytest.mark.parametrize("kind", ["mtp", "eagle3", pytest.param("dflash", marks=pytest.mark.slow),
                                  pytest.param("draft_target", marks=pytest.mark.slow),
                                  pytest.param("bigram", marks=pytest.mark.slow)])
def test_tree_decoding_is_lossless_greedy_under_page_pressure(prompts, reference, random_draft,  # noqa: F811
                                                             request, kind):
    """topk 4, depth 4, 8 draft tokens, 8 sequences in 40 pages: preemptions, K/V moved and freed, output unchanged;
    a trained head's tree accepts more per step than its chain at k = 4."""
    if kind == "draft_target":
        make = lambda e: DraftModelDrafter(e, load_transformer(random_draft))  # noqa: E731
    elif kind == "bigram":
        successor = torch.arange(1, 4097) % 4096
        make = lambda e: BigramDrafter(e, successor)  # noqa: E731
    else:
        head = _head(request, kind)
        make = lambda e: head_drafter(e, head)  # noqa: E731
    out = _tree_decode(prompts, make, TreeShape(4, 4, 8), 8, PRESSURE_PAGES)
    assert [r.tokens for r in out] == reference
    assert sum(r.stats.preemptions for r in out) > 0, "the case is meant to run under page pressure"
    if kind in ("mtp", "eagle3"):
        chain = decode(prompts, make, 4, 8)
        tau = [sum(e for r in run for e in r.stats.emitted) / sum(len(r.stats.emitted) for r in run)
               for run in (out, chain)]
        assert tau[0] > tau[1], tau


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("dflash", marks=pytest.mark.slow)])
def test_tree_sampling_follows_the_target(request, kind):
    """At temperature 1 the second and third tokens (both from tree steps) follow plain sampling's distribution:
    chi-square over 600 seeds each, as the chain's test does."""
    from test_speculative import chi_square_two_samples

    prompt = [0, 5, 300, 301, 302, 6]
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(), seed=s) for s in range(600)]
    plain = Engine.from_pretrained(TINY_TARGET, max_seqs=64).generate([prompt] * 600, params)
    head = _head(request, kind)
    spec = _tree_decode([prompt] * 600, lambda e: head_drafter(e, head), TreeShape(3, 2, 5), 64, params=params)
    assert sum(a for r in spec for a in r.stats.accepted) > 0
    for position in (1, 2):
        chi2, critical = chi_square_two_samples([r.tokens[position] for r in plain],
                                                [r.tokens[position] for r in spec])
        assert chi2 < critical, (position, chi2, critical)
