"""The speculative acceptance rule ``accept_draft``: lossless in distribution, and argmax equality when greedy.

The statistical tests run a small speculative decoder over a toy "language model" on V = 5 tokens: target and
draft are first-order Markov chains (an initial distribution and a transition matrix), so the target's
distribution at a position depends on the token before it, as a real model's does. Each trial has its own seed;
draft tokens are sampled from the draft distribution with that trial's generator, which ``accept_draft`` also
uses. Over many trials the emitted tokens must follow the target: checked with Pearson's chi-square against the
critical value at p = 0.001 (scipy is not a dependency, so the values are hard-coded: 18.467 for 4 degrees of
freedom, the 5 first tokens; 51.179 for 24, the 25 two-token sequences). The runs are seeded, so a test's outcome
is fixed; the same harness with a deliberately broken rule is rejected, which shows the test has the power to
catch a wrong residual.
"""

from __future__ import annotations

import pytest
import torch

from mtp_train.runtime.acceptance import accept_batch, accept_draft, accept_greedy
from mtp_train.runtime.sampling import SamplingParams, target_distribution

V = 5
CHI2_CRITICAL_P001 = {4: 18.467, 24: 51.179}  # chi-square quantile at 1 - 0.001, by degrees of freedom
TRIALS = 2500


def _normalise(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.sum(-1, keepdim=True)


# The target: initial distribution P0 and transitions T[prev]: row `prev` is one shape rolled by `prev`, so the
# favourite next token depends on the previous one; every entry is at least 0.07.
P0 = _normalise(torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08], dtype=torch.float64))
T = _normalise(torch.stack([torch.roll(torch.tensor([0.35, 0.25, 0.18, 0.14, 0.08], dtype=torch.float64), s)
                            for s in range(V)]) + torch.eye(V, dtype=torch.float64) * 0.1)


def _bad(p: torch.Tensor) -> torch.Tensor:
    """A draft that puts 90% of its mass on the target's two least likely tokens."""
    low = torch.argsort(p, dim=-1)[..., :2]
    q = torch.full_like(p, 0.1 / (V - 2))
    return q.scatter_(-1, low, 0.45)


def _good(p: torch.Tensor) -> torch.Tensor:
    """A draft close to the target: 85% target, 15% uniform."""
    return 0.85 * p + 0.15 / V


DRAFTS = {"bad": (_bad(P0), _bad(T)), "good": (_good(P0), _good(T))}


def accept_residual_from_target(draft_tokens, draft_probs, target_probs, generator=None):
    """A broken rule for the negative control: at a rejection it samples the target, not the residual."""
    k = draft_tokens.numel()
    for j in range(k):
        x = int(draft_tokens[j])
        p, q = float(target_probs[j, x]), float(draft_probs[j, x])
        if float(torch.rand((), generator=generator)) < min(1.0, p / q):
            continue
        return j, int(torch.multinomial(target_probs[j], 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def accept_batched(draft_tokens, draft_probs, target_probs, generator=None):
    """The runtime's batched rule (``accept_batch``) for one sequence, its k + 1 uniforms drawn from ``generator``."""
    k = draft_tokens.numel()
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    n, token = accept_batch(draft_tokens[None], draft_probs[None], target_probs[None], torch.tensor([k]), u[None, :k],
                            u[k:])
    return int(n[0]), int(token[0])


def sample(q: torch.Tensor, gen: torch.Generator) -> int:
    """One token from ``q`` by inverting its CDF with a uniform from ``gen`` (cheaper than ``multinomial``)."""
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    return min(int(torch.searchsorted(q.cumsum(0), torch.tensor(u, dtype=torch.float64), right=True)), V - 1)


def speculative_decode(n_tokens: int, k: int, q0, s, seed: int, rule=accept_draft) -> list[int]:
    """Generate ``n_tokens`` from the target chain by drafting k tokens from the draft chain and verifying them."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < n_tokens:
        last = out[-1] if out else None
        tokens, qs, ps = [], [], []
        for _ in range(k):
            q = q0 if last is None else s[last]
            x = sample(q, gen)
            tokens.append(x)
            qs.append(q)
            ps.append(P0 if last is None else T[last])
            last = x
        ps.append(P0 if last is None else T[last])  # the target's distribution after the last draft token
        n, nxt = rule(torch.tensor(tokens), torch.stack(qs), torch.stack(ps), gen)
        assert 0 <= n <= k and 0 <= nxt < V
        out += tokens[:n] + [nxt]
    return out[:n_tokens]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    assert float(expected.min()) >= 5, "too few trials for the chi-square approximation"
    return float(((counts - expected) ** 2 / expected).sum())


def first_token_counts(k: int, draft: str, rule=accept_draft, trials: int = TRIALS) -> torch.Tensor:
    q0, s = DRAFTS[draft]
    counts = torch.zeros(V, dtype=torch.float64)
    for seed in range(trials):
        counts[speculative_decode(1, k, q0, s, seed, rule)[0]] += 1
    return counts


def pair_counts(k: int, draft: str, trials: int = TRIALS, rule=accept_draft) -> torch.Tensor:
    q0, s = DRAFTS[draft]
    counts = torch.zeros(V * V, dtype=torch.float64)
    for seed in range(trials):
        a, b = speculative_decode(2, k, q0, s, 10**6 + seed, rule)
        counts[a * V + b] += 1
    return counts


def test_the_toy_drafts_are_what_they_claim():
    q0, s = DRAFTS["bad"]
    assert set(torch.topk(q0, 2).indices.tolist()) == set(torch.topk(-P0, 2).indices.tolist())
    # Total variation distance from the target: large for the bad draft, small for the good one.
    assert 0.5 * float((q0 - P0).abs().sum()) > 0.6
    assert 0.5 * float((DRAFTS["good"][0] - P0).abs().sum()) < 0.05
    for q0, s in DRAFTS.values():
        assert torch.allclose(q0.sum(), torch.tensor(1.0, dtype=torch.float64))
        assert torch.allclose(s.sum(-1), torch.ones(V, dtype=torch.float64))


@pytest.mark.parametrize("rule", [accept_draft, accept_batched], ids=["reference", "batched"])
@pytest.mark.parametrize("draft", ["bad", "good"])
@pytest.mark.parametrize("k", [1, 2])
def test_first_two_tokens_follow_the_target(k, draft, rule):
    # k = 1: token 2 is the bonus token whenever token 1 was an accepted draft. k = 2: both can be drafts.
    joint = (P0[:, None] * T).reshape(-1)  # P(x1) P(x2 | x1)
    counts = pair_counts(k, draft, rule=rule)
    stat = chi_square(counts, joint)
    assert stat < CHI2_CRITICAL_P001[V * V - 1], f"{draft} draft, k={k}: chi2 {stat:.1f}"
    # The first emitted token alone (the accepted draft token or the residual sample) follows the target.
    first = counts.reshape(V, V).sum(1)
    stat = chi_square(first, P0)
    assert stat < CHI2_CRITICAL_P001[V - 1], f"{draft} draft, k={k}, first token: chi2 {stat:.1f}, {first.tolist()}"


def test_the_chi_square_catches_a_rule_that_skips_the_residual():
    counts = first_token_counts(1, "bad", rule=accept_residual_from_target, trials=1000)
    assert chi_square(counts, P0) > CHI2_CRITICAL_P001[V - 1]


def test_acceptance_rate_is_the_overlap_of_target_and_draft():
    # One position: P(accept) = sum_x min(p(x), q(x)). Bad draft overlap here is 0.3.
    q0, _ = DRAFTS["bad"]
    overlap = float(torch.minimum(P0, q0).sum())
    trials, accepted = 1500, 0
    for seed in range(trials):
        gen = torch.Generator().manual_seed(seed)
        x = sample(q0, gen)
        n, _ = accept_draft(torch.tensor([x]), q0[None], torch.stack([P0, T[x]]), gen)
        accepted += n
    rate = accepted / trials
    sd = (overlap * (1 - overlap) / trials) ** 0.5
    assert abs(rate - overlap) < 4 * sd, (rate, overlap)


# --- greedy ------------------------------------------------------------------------------------------------

A, B, C, D, E = 1, 2, 3, 4, 5


def one_hot(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def greedy_target(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """Greedy target distributions as the runtime makes them: ``target_distribution`` of logits at temperature 0."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    probs = target_distribution(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, one_hot(argmaxes, vocab))
    return probs


@pytest.mark.parametrize("seed", [None, 0, 123])
def test_greedy_accepts_the_matching_prefix_then_the_target_argmax(seed):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    drafts = [A, B, C]
    assert accept_draft(torch.tensor(drafts), one_hot(drafts), greedy_target([A, B, D, E]), gen) == (2, D)


def test_greedy_all_accepted_gives_the_bonus_token():
    drafts = [A, B, C]
    assert accept_draft(torch.tensor(drafts), one_hot(drafts), greedy_target([A, B, C, E])) == (3, E)


def test_greedy_first_rejected_gives_the_target_argmax():
    drafts = [A, B, C]
    # Later drafts would match, but nothing after the first mismatch is accepted.
    assert accept_draft(torch.tensor(drafts), one_hot(drafts), greedy_target([D, B, C, E])) == (0, D)
    assert accept_draft(torch.tensor([C]), one_hot([C]), greedy_target([E, A])) == (0, E)


def test_greedy_target_with_a_sampled_draft_is_still_argmax_equality():
    # The draft sampled its tokens from soft distributions; the greedy target decides by argmax alone.
    drafts = [A, B, C]
    soft = torch.softmax(torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert accept_draft(torch.tensor(drafts), soft, greedy_target([A, B, D, E]), gen) == (2, D)
        assert accept_draft(torch.tensor(drafts), soft, greedy_target([A, B, C, E]), gen) == (3, E)


def test_the_batched_rules_decide_greedy_steps_as_the_reference_does():
    """Rows of different draft counts in one batch: ``accept_batch`` (any uniforms) and ``accept_greedy`` give
    the reference's decision for each row."""
    cases = [([A, B, C], [A, B, D, E]), ([A, B, C], [A, B, C, E]), ([A, B, C], [D, B, C, E]), ([C], [E, A]),
             ([B, B], [B, B, A])]
    k = 3
    drafts = torch.tensor([d + [0] * (k - len(d)) for d, _ in cases])
    lens = torch.tensor([len(d) for d, _ in cases])
    draft_probs = torch.stack([one_hot(d + [0] * (k - len(d))) for d, _ in cases])
    targets = torch.stack([greedy_target(t + [t[-1]] * (k + 1 - len(t))) for _, t in cases])
    expected = [accept_draft(torch.tensor(d), one_hot(d), greedy_target(t)) for d, t in cases]
    u = torch.rand(len(cases), k + 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n, token = accept_batch(drafts, draft_probs, targets, lens, u[:, :k], u[:, k])
    assert list(zip(n.tolist(), token.tolist())) == expected
    n, token = accept_greedy(drafts, targets.argmax(-1), lens)
    assert list(zip(n.tolist(), token.tolist())) == expected
