"""What one weight costs per token count at decode sizes on this CPU: the bound on a verify step's cost.

    .venv/bin/python bench/small_m_matmul.py [--threads 2]

For SmolLM2-135M's weight shapes (30 layers' q/k/v, o, gate/up and down projections, each a distinct random
tensor as a decode step reads them, and the 49,152-row lm_head), the wall time of multiplying M = 1, 2, 3, 4, 5
and 8 rows by all of them, in three layouts: ``F.linear`` on the ``[out, in]`` weight, ``x @ W.T`` on a transposed
``[in, out]`` copy, MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on a weight packed for that M), and the
runtime's own small-row kernel (``runtime/small_rows.cpp``, what ``runtime/small_batch.py`` keeps where it builds).
Milliseconds; then BLAS's best of the first three with its ratio to M = 1's, and the kernel's with its ratio to its
own M = 1: a speculative verify of k + 1 tokens at batch 1 costs what M = k + 1 costs here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import machine_line  # noqa: E402
from mtp_train.runtime import small_rows  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30
ROWS = (1, 2, 3, 4, 5, 8)


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, {args.threads} threads; ms for all {LAYERS} layers' weights of a shape "
          "(lm_head: one); linear / transposed / MKL packed -> BLAS best (x its M = 1) | kernel (x its M = 1)")
    print("| weight | " + " | ".join(f"M={m}" for m in ROWS) + " |\n|---|" + "---|" * len(ROWS))
    blas_sum, kernel_sum = dict.fromkeys(ROWS, 0.0), dict.fromkeys(ROWS, 0.0)
    for name, (out, inp) in SHAPES.items():
        weights = [torch.randn(out, inp) for _ in range(1 if name == "lm_head" else LAYERS)]
        transposed = [w.t().contiguous() for w in weights]
        kernel = [small_rows.pack(w) for w in weights] if small_rows.kernel() is not None else None
        cells, first, first_kernel = [], None, None
        for m in ROWS:
            x = torch.randn(m, inp)
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
            times = (timed(lambda: [F.linear(x, w) for w in weights]), timed(lambda: [x @ w for w in transposed]),
                     timed(lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(packed, weights)]))
            best = min(times)
            first = first or best
            blas_sum[m] += best
            cell = " / ".join(f"{t:.1f}" for t in times) + f" -> {best:.1f} (x{best / first:.2f})"
            if kernel is not None:
                ours = timed(lambda: [small_rows.linear(x, p, out) for p in kernel])
                first_kernel = first_kernel or ours
                kernel_sum[m] += ours
                cell += f" \\| **{ours:.1f}** (x{ours / first_kernel:.2f})"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print("| **a decode step's weights** | " + " | ".join(
        f"BLAS {blas_sum[m]:.1f} (x{blas_sum[m] / blas_sum[ROWS[0]]:.2f})"
        + (f" \\| **{kernel_sum[m]:.1f}** (x{kernel_sum[m] / kernel_sum[ROWS[0]]:.2f})" if kernel_sum[m] else "")
        for m in ROWS) + " |")


if __name__ == "__main__":
    main()
