"""v measured on its own: the target's verify forward timed outside the speculative loop, on contexts from the plain
run, at the batch sizes the plain run's decode steps had.

The expected speedup τ / (v + f·c) predicts the measured one only where its terms are measured apart from the
speculative run's wall time: c from the timed draft forwards (``SpecTimings.draft_s``), v from this probe, a forward
of the tokens a step verifies per sequence (k + 1, or a tree's N under its tree mask) with their logits, beside a
forward of one token per sequence, over contexts the plain run produced. Requests finish and a batch shrinks, so the
probe times both forwards at each batch size the plain run's decode steps ran at (:func:`probe_batches`; a few of
them, interpolated, where there were many), and :func:`at_batches` weighs each size by the decode steps that ran at it,
as the plain decode step's mean does (:func:`mtp_train.eval.timing.step_costs` puts v in plain decode steps). What the
prediction leaves out (acceptance, page bookkeeping, the host's wait, prefill and mixed steps) then shows as its gap
to the measured speedup (:func:`mtp_train.eval.step_costs.gap_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from mtp_train.runtime.batch import TreeMask
from mtp_train.runtime.device import synchronize, to_device
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams

REPEATS = 9
"""Timed forwards per width and batch size (after one untimed round), their median kept; the widths and sizes take
turns, round by round, so that a slow spell of the machine falls on all of them."""

MAX_PROBED_BATCHES = 8
"""The most batch sizes the probe times; where the plain runs had more, the others are interpolated."""


def probe_batches(runs: Iterable[Mapping[int, int]], most: int = MAX_PROBED_BATCHES) -> list[int]:
    """The batch sizes to probe, ascending, for plain runs whose decode steps ran at each size as often as ``runs``
    say (``PlainTiming.decode_batches``): every size seen when there are at most ``most``; otherwise the smallest,
    the largest, and between them sizes spread evenly over the range (half) and over the steps (the others, at
    evenly spaced quantiles: where most steps ran)."""
    steps: dict[int, int] = {}
    for run in runs:
        for b, n in run.items():
            steps[b] = steps.get(b, 0) + n
    sizes = sorted(b for b, n in steps.items() if n > 0)
    if len(sizes) <= most:
        return sizes
    spread, weighted = (most - 2) // 2, most - 2 - (most - 2) // 2
    low, high = sizes[0], sizes[-1]
    picked = {low, high} | {min(sizes, key=lambda b: abs(b - (low + (high - low) * (i + 1) / (spread + 1))))
                            for i in range(spread)}
    total, seen = sum(steps[b] for b in sizes), 0
    marks = [total * (i + 0.5) / weighted for i in range(weighted)]
    for b in sizes:
        seen += steps[b]
        while marks and seen >= marks[0]:
            picked.add(b)
            marks.pop(0)
    return sorted(picked)


def at_batches(seconds: Mapping[int, float], steps: Mapping[int, int]) -> float:
    """The mean of ``seconds`` (a forward's, by batch size probed) over decode steps that ran ``steps[b]`` times at
    batch size b: a size not probed takes the straight line between the probed sizes around it (the nearest one
    beyond their range)."""
    probed = sorted(seconds)
    if not probed:
        raise ValueError("no batch size was probed")

    def at(b: int) -> float:
        if b in seconds:
            return seconds[b]
        below = [x for x in probed if x < b]
        above = [x for x in probed if x > b]
        if not below or not above:
            return seconds[(below or above)[-1 if below else 0]]
        lo, hi = below[-1], above[0]
        return seconds[lo] + (seconds[hi] - seconds[lo]) * (b - lo) / (hi - lo)

    total = sum(steps.values())
    if total <= 0:
        raise ValueError("no decode step to weigh the probe by")
    return sum(n * at(b) for b, n in steps.items()) / total


def verify_forward_s(engine: Engine, contexts: list[list[int]], widths: list[tuple[int, bool]],
                     capture: tuple[int, ...] = (), batches: Iterable[int] | None = None
                     ) -> dict[tuple[int, bool], dict[int, float]]:
    """Median seconds of one verify forward of ``n`` tokens per context (``(n, tree)`` in ``widths``; a tree's
    tokens attend to the root and themselves, at depth 1), its logits included, at each batch size of ``batches``
    (the first b contexts; all of them when ``None``): ``{(n, tree): {b: seconds}}``."""
    sizes = sorted(set(batches)) if batches is not None else [len(contexts)]
    if not sizes or sizes[0] < 1 or sizes[-1] > len(contexts):
        raise ValueError(f"batch sizes {sizes} do not fit {len(contexts)} contexts")
    with torch.inference_mode():
        scheduler, seqs = engine.start(contexts, SamplingParams(max_new_tokens=2, stop_token_ids=()))
        while scheduler.waiting or any(len(s.pending) != 1 for s in scheduler.running):
            engine.step(scheduler)  # prefill: each context then holds its K/V and one pending token
        running = sorted(scheduler.running, key=lambda seq: seq.request_id)
        times: dict[tuple[int, bool, int], list[float]] = {(n, tree, b): [] for n, tree in widths for b in sizes}
        for _ in range(REPEATS + 1):
            for n, tree, b in times:
                times[n, tree, b].append(_one_forward(engine, running[:b], n, tree, capture))
        out: dict[tuple[int, bool], dict[int, float]] = {}
        for (n, tree, b), t in times.items():
            out.setdefault((n, tree), {})[b] = sorted(t[1:])[REPEATS // 2]
        for seq in running:
            scheduler.retire(seq)
    return out


def _one_forward(engine: Engine, seqs, n: int, tree: bool, capture: tuple[int, ...]) -> float:
    """Reserve ``n`` slots per sequence, forward its last token and ``n - 1`` of its context's, time it, truncate."""
    held = [seq.cached for seq in seqs]
    for seq in seqs:
        engine.allocator.reserve(seq.pages, n)
    scheduled = [(seq, (seq.tokens[-n:] if len(seq.tokens) >= n else seq.tokens[-1:] * n)) for seq in seqs]
    positions, mask = None, None
    if tree:
        depth = torch.tensor([0] + [1] * (n - 1))
        positions = (torch.tensor(held)[:, None] + depth).view(-1)
        sees = torch.eye(n, dtype=torch.bool)
        sees[:, 0] = True
        mask = TreeMask(held, [to_device(sees, engine.device)] * len(seqs))
    synchronize(engine.device)
    t0 = time.perf_counter()
    meta, hidden, _ = engine.forward(scheduled, capture, positions, mask)
    engine.model.logits(hidden)
    synchronize(engine.device)
    seconds = time.perf_counter() - t0
    for seq, before in zip(seqs, held):
        engine.allocator.truncate(seq.pages, before)
    return seconds
