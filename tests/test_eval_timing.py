"""Honest timing and losslessness in the eval: c over plain decode steps only, warm-up, the bf16 near-tie check."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET, sgd_chat_prompts
from mtp_train.eval.lossless import NEAR_TIE, SHOWN, STRICT, LosslessCheck, check_lossless, check_name, classify, summarize
from mtp_train.eval.report import Divergence
from mtp_train.eval.timing import PlainTiming, is_decode_step, plain_decode, step_costs, warm_up
from mtp_train.models.checkpoint import load_transformer
from mtp_train.runtime.engine import Engine, GenerationResult
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.sequence import RequestStats
from mtp_train.runtime.drafters import DraftModelDrafter
from mtp_train.runtime.speculative import SpecTimings, SpeculativeDecoder

GREEDY = SamplingParams(max_new_tokens=16, stop_token_ids=())
BF16 = NEAR_TIE.format(dtype="bf16")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return sgd_chat_prompts(4, 4)


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- c: the denominator is the plain decode step -------------------------------------------------------------


def test_only_steps_where_every_sequence_decodes_one_token_are_decode_steps():
    prefill, mixed, decode = [(None, [5, 6, 7])], [(None, [5]), (None, [8, 9])], [(None, [5]), (None, [6])]
    assert [is_decode_step(s) for s in (prefill, mixed, decode, [])] == [False, False, True, False]
    timing = PlainTiming()
    for scheduled, seconds in ((prefill, 10.0), (mixed, 6.0), (decode, 1.0), (decode, 1.5), (decode, 0.5)):
        timing.add_step(scheduled, seconds)
    assert (timing.steps, timing.decode_steps) == (5, 3)
    assert timing.decode_step_s == pytest.approx(1.0)  # all five steps would average 3.8 s
    c, v, cost = step_costs(SpecTimings(draft_s=0.6, draft_forwards=3, step_s=3.6, steps=2), timing)
    assert c == pytest.approx(0.2)
    assert v == pytest.approx(1.5), "(3.6 s of steps - 0.6 s of drafts) / 2 steps over the 1 s decode step"
    assert (cost.draft_forwards, cost.plain_steps, cost.plain_decode_steps, cost.spec_steps) == (3, 5, 3, 2)
    assert (cost.draft_forward_ms, cost.plain_decode_step_ms) == (pytest.approx(200.0), pytest.approx(1000.0))
    assert cost.verify_step_ms == pytest.approx(1500.0)
    assert step_costs(SpecTimings(0.6, 3), PlainTiming())[:2] == (0.0, None), "no decode step: nothing to divide by"
    assert step_costs(SpecTimings(), timing)[1] is None, "no speculative step: no v"


def test_a_plain_run_leaves_prefill_and_mixed_steps_out_of_the_decode_mean(prompts):
    """Two slots, three prompts of other lengths: the third is admitted beside a decoding one (a mixed step).
    A fake clock charges 100 s to any step that feeds more than one token to a sequence and 1 s to the others."""
    engine = Engine.from_pretrained(TINY_TARGET, max_seqs=2)
    clock, seen = FakeClock(), []
    step = engine.step

    def costed_step(scheduler, capture=()):
        scheduled, hidden, captured = step(scheduler, capture)
        seen.append([len(new) for _, new in scheduled])
        clock.now += 1.0 if all(n == 1 for n in seen[-1]) else 100.0
        return scheduled, hidden, captured

    engine.step = costed_step
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (3, 9, 6)]
    results, timing = plain_decode(engine, prompts[:3], params, clock=clock)
    assert [len(r.tokens) for r in results] == [3, 9, 6]
    assert any(max(n) > 1 and min(n) == 1 for n in seen), "the case is meant to hold a mixed step"
    slow = sum(any(n > 1 for n in s) for s in seen)
    assert slow >= 2 and timing.steps == len(seen)
    assert timing.decode_steps == len(seen) - slow > 0
    assert timing.decode_step_s == 1.0
    assert timing.wall_s == 100.0 * slow + timing.decode_steps  # the measured speedup's numerator: every step


def test_warm_up_runs_a_full_draft_chain_at_each_temperature(prompts, monkeypatch):
    import mtp_train.eval.timing

    runs = []

    class Recorded(SpeculativeDecoder):
        def generate(self, batch, params, on_step=None):
            out = super().generate(batch, params, on_step)
            runs.append((len(batch), sorted({p.temperature for p in params}), self.timings.draft_forwards, out))
            return out

    monkeypatch.setattr(mtp_train.eval.timing, "SpeculativeDecoder", Recorded)
    engine = Engine.from_pretrained(TINY_TARGET, max_seqs=4)
    k = 3
    warm_up(engine, DraftModelDrafter(engine, load_transformer(TINY_TARGET)), prompts, k, [0.0, 1.0])
    ((n, temperatures, forwards, out),) = runs
    assert n == 4 and temperatures == [0.0, 1.0]
    assert forwards >= k, "k - 1 chain forwards and a re-sync: the draft's first forwards are paid here"
    assert all(r.stats.accepted for r in out), "every warm-up request made at least one speculative step"


def test_the_decoder_times_its_speculative_steps_and_their_drafts(prompts):
    """Batch 1: one speculative step per verify the request made; the steps' time holds the drafts' time."""
    engine = Engine.from_pretrained(TINY_TARGET)
    decoder = SpeculativeDecoder(engine, DraftModelDrafter(engine, load_transformer(TINY_TARGET)), 2)
    (result,) = decoder.generate(prompts[:1], GREEDY)
    t = decoder.timings
    assert t.steps == len(result.stats.accepted) > 0
    assert t.step_s > t.draft_s > 0 and t.verify_s == pytest.approx(t.step_s - t.draft_s)


# -- lossless: the near-tie classifier and the check ---------------------------------------------------------


def test_classify_near_ties():
    ids, lps = [11, 22], [-0.70, -0.90]
    assert classify(11, 22, ids, lps, threshold=0.5) == (pytest.approx(0.2), True)
    assert classify(22, 11, ids, lps, threshold=0.5) == (pytest.approx(0.2), True), "either order"
    assert classify(11, 22, [11, 22], [-0.1, -3.0], threshold=0.5) == (pytest.approx(2.9), False), "large gap"
    assert classify(11, 33, ids, lps, threshold=0.5) == (None, False), "a token outside the top-2"
    assert classify(11, None, ids, lps, threshold=0.5) == (None, False), "one output ended"


def _scored_choice(engine: Engine, prompt: list[int], output: list[int], i: int) -> tuple[list[int], list[float]]:
    """The target's top-2 for generated token i, from one score of the whole sequence (row before token i)."""
    out = engine.score([prompt + output], layers=[-1], topk=2)
    row = len(prompt) + i - 1
    return out.topk_ids[row].tolist(), out.topk_logprobs[row].tolist()


def _altered(results: list[GenerationResult], which: int, i: int, token: int) -> list[GenerationResult]:
    spec = [GenerationResult(list(r.tokens), RequestStats()) for r in results]
    spec[which].tokens[i:] = [token, 7, 7]  # what follows a divergence does not matter
    return spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_divergence_is_scored_at_the_first_differing_token(prompts, dtype):
    """Real plain outputs of the tiny target, one token of the "speculative" output changed to the target's
    second choice there: a near-tie under a threshold above its gap, flagged under one below; a token outside
    the top-2 is always flagged. float32 is strict: any divergence fails."""
    engine = Engine.from_pretrained(TINY_TARGET, dtype=dtype, max_seqs=4)
    plain = engine.generate(prompts, GREEDY)
    names = [f"p/{n}" for n in range(len(prompts))]
    i = 5
    ids, lps = _scored_choice(engine, prompts[1], plain[1].tokens, i)
    assert ids[0] == plain[1].tokens[i] or dtype == torch.bfloat16  # the row is the one greedy decoding read
    second = ids[1] if ids[0] == plain[1].tokens[i] else ids[0]
    gap = lps[0] - lps[1]
    spec = _altered(plain, 1, i, second)

    loose = check_lossless(engine, "mtp, k=2", names, prompts, plain, spec, 0, threshold=gap + 0.01)
    (d,) = loose.divergences
    assert (d.prompt_id, d.index, d.plain_token, d.spec_token) == ("p/1", i, plain[1].tokens[i], second)
    assert d.gap == pytest.approx(gap, abs=1e-3 if dtype == torch.float32 else 0.07) and d.near_tie
    tight = check_lossless(engine, "mtp, k=2", names, prompts, plain, spec, 0, threshold=gap / 2)
    assert not tight.divergences[0].near_tie and not tight.lossless
    outside = next(t for t in range(100, 4096) if t not in ids)
    far = check_lossless(engine, "mtp, k=2", names, prompts, plain, _altered(plain, 1, i, outside), 0, threshold=99.0)
    assert far.divergences[0].gap is None and not far.divergences[0].near_tie and not far.lossless
    if dtype == torch.float32:
        assert loose.method == STRICT and not loose.lossless, "fp32: token identity, near-tie or not"
    else:
        assert loose.method == BF16 and loose.lossless, "bf16: a near-tie is not a loss"
        assert "not the target's top-2" in far.why()


def test_speculative_decoding_in_bf16_passes_the_near_tie_check(prompts):
    """The tiny target in bf16 with itself as the draft: no greedy violation, and nothing but near-ties."""
    engine = Engine.from_pretrained(TINY_TARGET, dtype=torch.bfloat16, max_seqs=4)
    assert check_name(engine) == BF16
    plain = engine.generate(prompts, GREEDY)
    decoder = SpeculativeDecoder(engine, DraftModelDrafter(engine, load_transformer(TINY_TARGET, dtype=torch.bfloat16)), 3)
    spec = decoder.generate(prompts, GREEDY)
    check = check_lossless(engine, "draft_target, k=3", [str(n) for n in range(4)], prompts, plain, spec,
                           decoder.greedy_violations)
    assert check.greedy_violations == 0 and check.lossless, check.why()
    assert sum(a for r in spec for a in r.stats.accepted) > 0


def test_greedy_violations_fail_the_bf16_check(prompts, monkeypatch):
    assert not LosslessCheck("mtp, k=2", BF16, greedy_violations=1).lossless, "without any divergence"
    assert LosslessCheck("mtp, k=2", BF16, greedy_violations=0).lossless
    # A broken acceptance rule (accept every draft) in a real bf16 run is caught.
    import mtp_train.runtime.speculative as spec_module

    monkeypatch.setattr(spec_module, "accept_greedy", lambda drafts, own, lens: (lens, own.gather(1, lens[:, None])[:, 0]))
    engine = Engine.from_pretrained(TINY_TARGET, dtype=torch.bfloat16, max_seqs=4)
    plain = engine.generate(prompts, GREEDY)
    draft = load_transformer(TINY_TARGET, dtype=torch.bfloat16)
    torch.nn.init.normal_(draft.output.weight)  # a draft that disagrees with the target
    decoder = SpeculativeDecoder(engine, DraftModelDrafter(engine, draft), 3)
    spec = decoder.generate(prompts, GREEDY)
    check = check_lossless(engine, "x, k=3", [str(n) for n in range(4)], prompts, plain, spec,
                           decoder.greedy_violations)
    assert check.greedy_violations > 0 and not check.lossless
    assert "greedy violation" in check.why()


def test_summary_over_sweep_points_caps_the_listed_divergences():
    def div(n: int, tie: bool) -> Divergence:
        return Divergence(draft="mtp, k=1", prompt_id=f"p/{n}", index=n, plain_token=1, spec_token=2,
                          gap=0.1 if tie else 3.0, near_tie=tie)

    ties = LosslessCheck("mtp, k=1", BF16, 0, [div(n, True) for n in range(SHOWN + 2)])
    assert summarize([], BF16) == {"lossless": None, "lossless_detail": None}
    good = summarize([ties], BF16)
    assert good["lossless"] is True and good["num_divergences"] == SHOWN + 2 and len(good["divergences"]) == SHOWN
    assert good["lossless_check"] == BF16 and good["greedy_violations"] == 0 and good["near_tie_nats"] > 0
    bad = summarize([ties, LosslessCheck("eagle, k=2", BF16, 3, [div(0, False)])], BF16)
    assert bad["lossless"] is False and bad["greedy_violations"] == 3 and "eagle, k=2" in bad["lossless_detail"]
    strict = summarize([LosslessCheck("mtp, k=1", STRICT, 0, [div(0, True)])], STRICT)
    assert strict["lossless"] is False and strict["near_tie_nats"] is None
