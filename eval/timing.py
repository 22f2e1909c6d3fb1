"""Wall-clock timing of the eval: plain decoding timed step by step, speculative runs, warm-up, c and v.

c and v are in one unit, the plain **decode** step as the plain run measured it (the whole ``Engine.step``:
scheduling, the forward, sampling, bookkeeping), so that τ / (v + f·c) divides like by like:

- **c**, the draft cost ratio = (mean wall time of one batched draft forward in speculative decode steps) /
  (mean wall time of one plain decode step). A plain decode step is one in which every scheduled sequence
  decodes exactly one token; prefill and mixed steps forward many tokens per sequence, and averaging them in
  would make the denominator too large, c too small and the expected speedup τ / (v + k·c) too high.
- **v**, the verify cost ratio = (the plain decode step − its one-token forward + the verify forward) / (the plain
  decode step): a speculative step's verify predicted as a plain decode step whose forward is widened from one
  token per sequence to the step's k + 1 (or a tree's N) with their logits. The two forwards are timed alone outside
  the speculative loop, turn about, on contexts from the plain run, at the batch sizes the plain run's decode steps
  had, and weighed by the decode steps at each size as the plain decode step's mean is
  (:mod:`mtp_train.eval.verify_probe`). v is near 1 where verifying k + 1 tokens costs what decoding one does (a
  memory-bound target) and grows where it is compute-bound. Nothing in it comes from the speculative run, so
  τ / (v + f·c) is a prediction: what it leaves out (acceptance beyond a plain step's sampling and bookkeeping,
  prefill and mixed steps, the speculative run's own batch sizes) is its gap to the measured speedup. Where v cannot
  be measured (no probe, no plain decode step) it is ``None`` and the report says so.
- The **measured speedup** is the wall time of the whole plain run over that of the whole speculative run, the
  same prompts at the same batch size.
- Every clock reading is preceded by ``synchronize(device)`` (a no-op on CPU), so that work queued on a GPU is
  charged to the region that queued it. The draft forwards are timed by the decoder itself, with CUDA events read
  once at the end of its run (`mtp_train.runtime.clock`), so its steps make no sync for timing.
- Nothing is timed cold: the first forwards of a process (allocations, kernel selection) are paid by an
  untimed warm-up, plain decoding once and speculative decoding once per draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtp_train.eval.report import DraftCost
from mtp_train.eval.verify_probe import at_batches
from mtp_train.runtime.device import synchronize
from mtp_train.runtime.engine import Engine, GenerationResult
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.sequence import Sequence
from mtp_train.runtime.drafters import Drafter
from mtp_train.runtime.speculative import SpecTimings, SpeculativeDecoder
from mtp_train.runtime.tree import TreeShape
from mtp_train.runtime.tree_decoder import TreeDecoder

Clock = Callable[[], float]
OnStep = Callable[[list[Sequence]], None]

WARM_UP_PROMPTS = 2
"""Prompts of the untimed speculative warm-up of each draft (at each eval temperature)."""


def is_decode_step(scheduled: list[tuple[Sequence, list[int]]]) -> bool:
    """Whether every sequence of a plain step (``Engine.step``'s batch) fed exactly one new token."""
    return bool(scheduled) and all(len(new) == 1 for _, new in scheduled)


@dataclass
class PlainTiming:
    """One plain run: its wall time, its steps, and the time and count of its pure decode steps, these also counted by
    batch size (``decode_batches``: the sizes the verify probe times, and their weights)."""

    wall_s: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    decode_batches: dict[int, int] = field(default_factory=dict)

    def add_step(self, scheduled: list[tuple[Sequence, list[int]]], seconds: float) -> None:
        self.steps += 1
        if is_decode_step(scheduled):
            self.decode_steps += 1
            self.decode_s += seconds
            self.decode_batches[len(scheduled)] = self.decode_batches.get(len(scheduled), 0) + 1

    @property
    def decode_step_s(self) -> float:
        """Mean wall time of one plain decode step (0.0 when there was none, e.g. every request stopped at once)."""
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0


def step_costs(spec: SpecTimings, plain: PlainTiming,
               probe: tuple[dict[int, float], dict[int, float]] | None = None,
               spec_wall_s: float | None = None) -> tuple[float, float | None, DraftCost]:
    """c, v and the record of their terms, both over the plain decode step. ``probe``: the verify forward's and the
    one-token forward's seconds by batch size (``verify_forward_s``), weighed here by the plain run's decode steps at
    each size. v is ``None`` where it cannot be measured: no probe, or no plain decode step (c is then 0.0: nothing to
    divide by). The loop's own time outside its drafts is recorded (``verify_step_ms``) but never taken for v: it is
    the measured result the expected speedup predicts."""
    forward_s = spec.draft_s / spec.draft_forwards if spec.draft_forwards else 0.0
    verify_s = spec.verify_s / spec.steps if spec.steps else 0.0
    step = plain.decode_step_s
    c = forward_s / step if step > 0 else 0.0
    v = verify_fwd = one_fwd = weights = None
    if step > 0 and probe is not None and plain.decode_batches:
        weights = dict(sorted(plain.decode_batches.items(), reverse=True))
        verify_fwd, one_fwd = at_batches(probe[0], weights), at_batches(probe[1], weights)
        widened = step - one_fwd + verify_fwd  # the plain decode step with its forward widened to the verify's
        v = widened / step if widened > 0 else None
    record = DraftCost(draft_forwards=spec.draft_forwards, draft_forward_ms=round(forward_s * 1e3, 4),
                       plain_steps=plain.steps, plain_decode_steps=plain.decode_steps,
                       plain_decode_step_ms=round(step * 1e3, 4), spec_steps=spec.steps,
                       verify_step_ms=round(verify_s * 1e3, 4),
                       verify_forward_ms=None if verify_fwd is None else round(verify_fwd * 1e3, 4),
                       decode_forward_ms=None if one_fwd is None else round(one_fwd * 1e3, 4),
                       decode_batch_steps=weights,
                       plain_wall_s=round(plain.wall_s, 4),
                       spec_wall_s=None if spec_wall_s is None else round(spec_wall_s, 4))
    return c, v, record


def plain_decode(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 on_step: OnStep | None = None, clock: Clock = time.perf_counter
                 ) -> tuple[list[GenerationResult], PlainTiming]:
    """Plain decoding through the runtime, each step timed on its own; ``on_step`` (progress) is not timed
    per step but is in the run's wall time, as it is in the speculative run's."""
    timing = PlainTiming()
    with torch.inference_mode():
        synchronize(engine.device)
        start = clock()
        scheduler, seqs = engine.start(prompts, params)
        while not scheduler.done:
            synchronize(engine.device)
            t0 = clock()
            scheduled, _, _ = engine.step(scheduler)
            synchronize(engine.device)
            timing.add_step(scheduled, clock() - t0)
            if on_step is not None:
                on_step(seqs)
        synchronize(engine.device)
        timing.wall_s = clock() - start
    return [GenerationResult(s.output, s.stats) for s in seqs], timing


def timed_generate(decoder: SpeculativeDecoder, prompts: list[list[int]], params: list[SamplingParams],
                   on_step: OnStep | None = None, clock: Clock = time.perf_counter
                   ) -> tuple[list[GenerationResult], float]:
    """Speculative decoding of ``prompts`` and its wall time."""
    synchronize(decoder.engine.device)
    t0 = clock()
    results = decoder.generate(prompts, params, on_step=on_step)
    synchronize(decoder.engine.device)
    return results, clock() - t0


def warm_up(engine: Engine, drafter: Drafter, prompts: list[list[int]], k: int, temperatures: list[float],
            trees: list[TreeShape] = ()) -> None:
    """An untimed speculative run of ``prompts[:WARM_UP_PROMPTS]`` at each temperature, long enough for a full
    chain of ``k`` drafts (and for each of ``trees``), so that the draft's first forwards are not charged to a timed
    sweep point."""
    few = prompts[:WARM_UP_PROMPTS]
    batch = [p for _ in temperatures for p in few]
    for decoder in [SpeculativeDecoder(engine, drafter, k)] + [TreeDecoder(engine, drafter, t) for t in trees]:
        params = [SamplingParams(temperature=t, max_new_tokens=decoder.k + 2, seed=i)
                  for t in temperatures for i in range(len(few))]
        decoder.generate(batch, params)
