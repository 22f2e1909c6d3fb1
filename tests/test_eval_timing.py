"""Honest timing and losslessness in the eval: c over plain decode steps only, warm-up, the bf16 near-tie check."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET, sgd_chat_prompts
from mtp_train.eval.lossless import NEAR_TIE, SHOWN, STRICT, LosslessCheck, check_lossless, check_name, classify, summarize
from mtp_train.eval.report import Divergence
from mtp_train.eval.metrics import expected_speedup
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
    assert (cost.draft_forwards, cost.plain_steps, cost.plain_decode_steps, cost.spec_steps) == (3, 5, 3, 2)
    assert (cost.draft_forward_ms, cost.plain_decode_step_ms) == (pytest.approx(200.0), pytest.approx(1000.0))
    assert cost.verify_step_ms == pytest.approx(1500.0)
    assert step_costs(SpecTimings(0.6, 3), PlainTiming())[:2] == (0.0, None), "no decode step: nothing to divide by"


def test_without_the_probe_v_is_not_measured_rather_than_taken_from_the_run_it_predicts():
    """The speculative loop's own time outside its drafts (1.5 s a step here) is the measured result the expected
    speedup predicts: v derived from it would restate the measurement. Without a probe v is ``None``."""
    timing = PlainTiming()
    for _ in range(3):
        timing.add_step([(None, [5])], 1.0)
    c, v, cost = step_costs(SpecTimings(draft_s=0.6, draft_forwards=3, step_s=3.6, steps=2), timing)
    assert c == pytest.approx(0.2) and v is None
    assert cost.verify_forward_ms is None and cost.decode_batch_steps is None


def test_a_plain_run_counts_its_decode_steps_by_batch_size():
    timing = PlainTiming()
    four, two, mixed = [(None, [5])] * 4, [(None, [5])] * 2, [(None, [5]), (None, [6, 7])]
    for scheduled in (four, mixed, four, four, two):
        timing.add_step(scheduled, 1.0)
    assert timing.decode_batches == {4: 3, 2: 1}, "the mixed step is no decode step"


def test_c_and_v_are_in_one_unit_the_plain_decode_step_as_the_run_measured_it():
    """Injected timings of a run in which every step spends O = 4 ms scheduling, sampling and booking beside its
    forwards: a plain decode step is O + a one-token forward, a speculative step O + a verify forward + k draft
    forwards. 30 plain decode steps ran at batch 4 and 10 at batch 2, and the speculative steps in the same
    proportion; the probe timed the bare forwards at both sizes. c and v are both over the plain decode step the run
    measured (9.75 ms), so that τ / (v + k·c) is the run's speedup; v as a ratio of bare forwards (8.5 ms / 5.75 ms =
    1.48) is in other units than c and would predict too low a speedup."""
    overhead, k, draft = 4e-3, 2, 1e-3
    one, verify = {4: 6e-3, 2: 5e-3}, {4: 9e-3, 2: 7e-3}
    plain = PlainTiming()
    for b, n in ((4, 30), (2, 10)):
        for _ in range(n):
            plain.add_step([(None, [1])] * b, overhead + one[b])
    step = plain.decode_step_s
    assert step == pytest.approx(9.75e-3)
    spec_steps = {4: 15, 2: 5}
    spec = SpecTimings(draft_s=20 * k * draft, draft_forwards=20 * k, steps=20,
                       step_s=sum(n * (overhead + verify[b] + k * draft) for b, n in spec_steps.items()))
    c, v, cost = step_costs(spec, plain, (verify, one), spec_wall_s=1.0)
    assert c == pytest.approx(draft / step)
    assert v == pytest.approx((overhead + 8.5e-3) / step), "a plain decode step with its forward widened to the verify"
    tau = 2.5
    truth = tau * step / (spec.step_s / spec.steps)  # plain time per token over speculative time per token
    assert expected_speedup(tau, k, c, v) == pytest.approx(truth)
    assert expected_speedup(tau, k, c, 8.5 / 5.75) < 0.9 * truth, "the bare forward ratio, in other units"
    assert cost.decode_batch_steps == {4: 30, 2: 10}
    assert (cost.verify_forward_ms, cost.decode_forward_ms) == (pytest.approx(8.5), pytest.approx(5.75))


def test_many_batch_sizes_are_probed_at_a_few_and_weighted_by_their_steps():
    from mtp_train.eval.verify_probe import MAX_PROBED_BATCHES, at_batches, probe_batches

    steps = {b: 1 for b in range(1, 65)}
    steps[64] = 500  # a full batch most of the run, then every size down to 1 as requests finish
    sizes = probe_batches([steps])
    assert len(sizes) <= MAX_PROBED_BATCHES and sizes[0] == 1 and sizes[-1] == 64 and sizes == sorted(set(sizes))
    assert probe_batches([{4: 3, 2: 1}, {3: 1, 4: 9}]) == [2, 3, 4], "every size of every plain run, when few"
    times = {b: 1e-3 + 2e-4 * b for b in sizes}  # linear in the batch size: interpolation between sizes is exact
    mean = sum(n * (1e-3 + 2e-4 * b) for b, n in steps.items()) / sum(steps.values())
    assert at_batches(times, steps) == pytest.approx(mean)
    assert at_batches({4: 2.0}, {4: 1, 2: 3}) == pytest.approx(2.0), "one probed size stands for all"


def test_the_probe_times_the_batch_sizes_the_plain_run_had(prompts, monkeypatch):
    """Four requests of 3 to 9 tokens in one batch of four: the batch shrinks to 3, 2 and 1 as they finish, and the
    probe times its forwards at each of those sizes, not at the full batch alone."""
    import mtp_train.eval.verify_probe as probe
    from mtp_train.eval.verify_probe import probe_batches, verify_forward_s

    engine = Engine.from_pretrained(TINY_TARGET, max_seqs=4)
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (3, 5, 7, 9)]
    results, timing = plain_decode(engine, prompts, params)
    assert sorted(timing.decode_batches) == [1, 2, 3, 4]
    sizes = probe_batches([timing.decode_batches])
    assert sizes == [1, 2, 3, 4]
    monkeypatch.setattr(probe, "REPEATS", 1)
    asked, forward = [], probe._one_forward
    monkeypatch.setattr(probe, "_one_forward",
                        lambda engine, seqs, n, tree, capture: asked.append(len(seqs)) or forward(engine, seqs, n, tree,
                                                                                                 capture))
    contexts = [ids + r.tokens[: len(r.tokens) // 2] for ids, r in zip(prompts, results)]
    out = verify_forward_s(engine, contexts, [(1, False), (3, False), (4, True)], batches=sizes)
    assert set(out) == {(1, False), (3, False), (4, True)}
    assert all(sorted(t) == [1, 2, 3, 4] and min(t.values()) > 0 for t in out.values())
    assert sorted(set(asked)) == [1, 2, 3, 4]
    c, v, cost = step_costs(SpecTimings(draft_s=0.01, draft_forwards=2, step_s=0.05, steps=2), timing,
                            (out[3, False], out[1, False]))
    assert cost.decode_batch_steps == timing.decode_batches  # the weights of the forwards timed at each size
    assert cost.verify_forward_ms > 0 and cost.decode_forward_ms > 0


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
