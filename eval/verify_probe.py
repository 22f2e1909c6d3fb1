"""v measured on its own: the target's verify forward timed outside the speculative loop, on contexts from the plain
run.

The expected speedup τ / (v + f·c) predicts the measured one only where its terms are measured apart from the
speculative run's wall time: c from the timed draft forwards (``SpecTimings.draft_s``), v from this probe, a forward
of the tokens a step verifies per sequence (k + 1, or a tree's N under its tree mask) with their logits, at the eval's
batch size, over contexts the plain run produced. What the prediction leaves out (acceptance, page bookkeeping, the
host's wait, prefill and mixed steps) then shows as its gap to the measured speedup (``step_costs.gap_note``).
"""

from __future__ import annotations

import time

import torch

from mtp_train.runtime.batch import TreeMask
from mtp_train.runtime.device import synchronize, to_device
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams

REPEATS = 9
"""Timed forwards per width (after one untimed round), their median kept; the widths take turns, round by round, so
that a slow spell of the machine falls on all of them."""


def verify_forward_s(engine: Engine, contexts: list[list[int]], widths: list[tuple[int, bool]],
                     capture: tuple[int, ...] = ()) -> dict[tuple[int, bool], float]:
    """Median seconds of one verify forward of ``n`` tokens per context (``(n, tree)`` in ``widths``; a tree's
    tokens attend to the root and themselves, at depth 1), its logits included."""
    with torch.inference_mode():
        scheduler, seqs = engine.start(contexts, SamplingParams(max_new_tokens=2, stop_token_ids=()))
        while scheduler.waiting or any(len(s.pending) != 1 for s in scheduler.running):
            engine.step(scheduler)  # prefill: each context then holds its K/V and one pending token
        running = list(scheduler.running)
        times: dict[tuple[int, bool], list[float]] = {width: [] for width in widths}
        for _ in range(REPEATS + 1):
            for n, tree in times:
                times[n, tree].append(_one_forward(engine, running, n, tree, capture))
        out = {width: sorted(t[1:])[REPEATS // 2] for width, t in times.items()}
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
