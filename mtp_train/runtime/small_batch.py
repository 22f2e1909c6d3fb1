"""The small-batch weight layout on CPU: which of the target's matmuls run faster from a copy at 1 to 8 rows.

A decode step multiplies each weight by a handful of rows (one per sequence, k + 1 in a verify), so its cost
should be the weight's read. CPU BLAS's small-M kernels instead cost per row (on this project's 2-core machine two
rows cost 1.5–2.1× one, ``bench/small_m_matmul.py``), and their speed depends on the weight's layout, by shape. So
``tune`` measures, once per process, for each distinct weight shape and each row count 1..``MAX_ROWS``, the stored
layout (``F.linear``) against one copy over every weight of that shape (so that the times are of memory reads,
not of cache hits), and gives the shape's ``Linear`` modules that copy for the row counts where it is faster by
``MARGIN``. The copy is the packed weight of ``runtime/small_rows.py``'s kernel, which reads the weight once for
all rows, where that kernel builds; otherwise a transposed ``[in, out]`` copy, which BLAS reads faster for some
shapes. It costs the copy's memory, on CPU only, and changes products only by rounding (the parity tests run
with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.models.parts import Linear
from mtp_train.runtime import small_rows

MAX_ROWS = small_rows.MAX_ROWS  # batch-8 decode steps, and verifies of k <= 7 at batch 1
MARGIN = 1.15  # the copy must be this much faster to be worth its memory
REPEATS = 3
_MEASURED: dict[tuple[tuple[int, int], int, int, str], list[int]] = {}
Product = Callable[[torch.Tensor], torch.Tensor]


def _time(fn, repeats: int = REPEATS) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _packed(weight: torch.Tensor) -> Product:
    packed, out = small_rows.pack(weight), weight.shape[0]
    return lambda x: small_rows.linear(x, packed, out)


def _transposed(weight: torch.Tensor) -> Product:
    w_t = weight.t().contiguous()
    return lambda x: x @ w_t


def copy_kind() -> str:
    """``packed`` where the small-row kernel builds on this machine, else ``transposed``."""
    return "packed" if small_rows.kernel() is not None else "transposed"


def tune(model: nn.Module, kind: str | None = None) -> dict[tuple[int, int], list[int]]:
    """Give ``model``'s float32 CPU ``Linear`` modules a copy of their weight (``kind``: ``packed`` or
    ``transposed``, by default ``copy_kind()``) for the row counts where it pays; returns ``(out, in)`` shape ->
    those row counts (for logs and benchmarks)."""
    kind = kind or copy_kind()
    make = _packed if kind == "packed" else _transposed
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    chosen: dict[tuple[int, int], list[int]] = {}
    with torch.no_grad():
        for shape, modules in by_shape.items():
            products = None  # the copies, made only to be measured or kept
            key = (shape, len(modules), torch.get_num_threads(), kind)
            if key not in _MEASURED:  # once per process for a shape, count, thread count and kind
                products = [make(m.weight) for m in modules]
                weights, rows = [m.weight for m in modules], []
                for n in range(1, MAX_ROWS + 1):
                    x = torch.randn(n, shape[1])
                    stored = _time(lambda: [F.linear(x, w) for w in weights])
                    copied = _time(lambda: [product(x) for product in products])
                    if stored > MARGIN * copied:
                        rows.append(n)
                _MEASURED[key] = rows
            if rows := _MEASURED[key]:
                for module, product in zip(modules, products or [make(m.weight) for m in modules]):
                    module.small_rows = dict.fromkeys(rows, product)
                chosen[shape] = rows
    return chosen
