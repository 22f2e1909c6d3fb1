"""What one weight costs per token count at decode sizes on this CPU: the bound on a verify step's cost.

    .venv/bin/python bench/small_m_matmul.py [--threads 2]

For SmolLM2-135M's weight shapes (30 layers' q/k/v, o, gate/up and down projections, each a distinct random
tensor as a decode step reads them, and the 49,152-row lm_head), the wall time of multiplying M = 1, 2, 3, 4, 5
and 8 rows by all of them, in three layouts: ``F.linear`` on the ``[out, in]`` weight, ``x @ W.T`` on a transposed
``[in, out]`` copy (what ``runtime/small_batch.py`` may keep), and MKL's packed GEMM
(``torch.ops.mkl._mkl_linear`` on a weight packed for that M). Milliseconds, best layout per M in the last column,
its ratio to M = 1 in brackets: a speculative verify of k + 1 tokens at batch 1 costs what M = k + 1 costs here.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

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
    print(f"torch {torch.__version__}, {args.threads} threads; ms for all {LAYERS} layers' weights of a shape "
          "(lm_head: one); linear / transposed / MKL packed -> best (x M = 1's best)")
    print("| weight | " + " | ".join(f"M={m}" for m in ROWS) + " |\n|---|" + "---|" * len(ROWS))
    for name, (out, inp) in SHAPES.items():
        weights = [torch.randn(out, inp) for _ in range(1 if name == "lm_head" else LAYERS)]
        transposed = [w.t().contiguous() for w in weights]
        cells, first = [], None
        for m in ROWS:
            x = torch.randn(m, inp)
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
            times = (timed(lambda: [F.linear(x, w) for w in weights]), timed(lambda: [x @ w for w in transposed]),
                     timed(lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(packed, weights)]))
            best = min(times)
            first = first or best
            cells.append(" / ".join(f"{t:.1f}" for t in times) + f" -> {best:.1f} (x{best / first:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
