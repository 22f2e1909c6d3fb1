"""The small-batch weight layout on CPU: which of the target's matmuls read faster transposed at 1 to 5 rows.

A decode step multiplies each weight by a handful of rows (one per sequence, k + 1 in a verify), so it reads the
whole weight for little arithmetic. At those sizes CPU BLAS picks kernels whose speed depends on the weight's
layout, and by shape: on this project's 2-core machine ``x @ W.T`` at one row reads SmolLM2's gate/up and lm_head
weights at 10 GB/s in the stored ``[out, in]`` layout and at 17–20 GB/s from a ``[in, out]`` copy, while its down
projection is faster as stored (``bench/RESULTS.md``). So ``tune`` measures, once per engine, for each distinct
weight shape and each row count 1..``MAX_ROWS``, both layouts over every weight of that shape (so that the times
are of memory reads, not of cache hits), and gives the shape's ``Linear`` modules a transposed copy for the row
counts where it is faster by ``MARGIN``. It costs that copy's memory, on CPU only, and changes products only by
rounding (the parity tests run with it).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from mtp_train.models.parts import Linear

MAX_ROWS = 5  # decode steps and verifies of k <= 4 at batch 1
MARGIN = 1.15  # the transposed copy must be this much faster to be worth its memory
REPEATS = 3
_MEASURED: dict[tuple[tuple[int, int], int, int], list[int]] = {}


def _time(fn, repeats: int = REPEATS) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def tune(model: nn.Module) -> dict[tuple[int, int], list[int]]:
    """Give ``model``'s ``Linear`` modules their transposed copies where they pay; returns ``(out, in)`` shape ->
    the row counts that use it (for logs and benchmarks)."""
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    chosen: dict[tuple[int, int], list[int]] = {}
    with torch.no_grad():  # not inference mode: the copies must be usable where autograd records
        for shape, modules in by_shape.items():
            weights = [m.weight for m in modules]
            transposed = [w.t().contiguous() for w in weights]
            key = (shape, len(weights), torch.get_num_threads())
            if key not in _MEASURED:  # once per process for a shape, count and thread count
                rows = []
                for n in range(1, MAX_ROWS + 1):
                    x = torch.randn(n, shape[1])
                    stored = _time(lambda: [torch.nn.functional.linear(x, w) for w in weights])
                    flipped = _time(lambda: [x @ w for w in transposed])
                    if stored > MARGIN * flipped:
                        rows.append(n)
                _MEASURED[key] = rows
            rows = _MEASURED[key]
            if rows:
                for module, w_t in zip(modules, transposed):
                    module.weight_t, module.transposed_for = w_t, frozenset(rows)
                chosen[shape] = rows
    return chosen
