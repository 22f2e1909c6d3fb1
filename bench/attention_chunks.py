"""Training step time of the heads that run ``range_attention`` (eagle3's training-time test, dflash's blocks), with
its chunks packed by document against one chunk over as many packed documents as the byte budget allows (the
chunker before 88e8efd), side by side in one process on the same batch; the losses must be equal.

    .venv/bin/python bench/attention_chunks.py --features runs/scaling/tiny/base/features    # after bench/scaling.py

One training micro-batch of the tiny default's features (4,096 tokens, SGD dialogues of about 270 tokens), a fresh
head of each kind, forward and backward of the trainer's objective, alternating the two chunkers, best of
``--repeats``.
"""

from __future__ import annotations

import argparse
import sys
import time
from bisect import bisect_right
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.machine import machine_line  # noqa: E402
from mtp_train.heads import attention  # noqa: E402


def budget_only(self, heads: int, extra: int) -> list[tuple[int, int]]:
    """The previous chunker: the most whole groups within the byte budget, whatever documents they span."""
    rows, out, r0 = len(self.lo), [], 0
    while r0 < rows:
        most = (rows - r0) // self.group
        groups = max(1, bisect_right(range(1, most + 1), attention.SCORE_CHUNK_BYTES,
                                     key=lambda g: self._cost(r0, r0 + g * self.group, heads, extra)))
        out.append((r0, r0 + groups * self.group))
        r0 += groups * self.group
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", default=str(REPO / "runs/scaling/tiny/base/features"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from mtp_train.heads import build_head
    from mtp_train.recipe import load_recipe
    from mtp_train.train.data import load_batch, plan_batches
    from mtp_train.train.objective import loss_weights, objective
    from mtp_train.train.trainer import TrainInputs

    print(machine_line())
    packed = attention.KeyRanges.chunks
    print("| head | chunks by budget only, s | packed by document, s | speedup | loss equal |\n|---|---:|---:|---:|---|")
    for kind in ("eagle3", "dflash"):
        recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [f"head.kind={kind}", "eval.compare=[]",
                                                               f"precompute.features_dir={args.features}"])
        inputs = TrainInputs.read(recipe)
        torch.manual_seed(0)
        head = build_head(inputs.spec)
        ids = plan_batches(inputs.reader.train, 4096, 0, 0)[0]
        batch = load_batch(inputs.reader, [inputs.reader.train[i] for i in ids], 4096, torch.float32, aux=inputs.aux)
        weights = loss_weights(recipe)
        best, losses = {}, {}
        for _ in range(args.repeats):
            for name, chunker in (("budget", budget_only), ("packed", packed)):
                attention.KeyRanges.chunks = chunker
                started = time.perf_counter()
                loss, _ = objective(head, inputs.frozen, batch, weights)
                loss.backward()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
                losses[name] = float(loss.detach())
                head.zero_grad(set_to_none=True)
        attention.KeyRanges.chunks = packed
        print(f"| {kind} | {best['budget']:.3f} | {best['packed']:.3f} | {best['budget'] / best['packed']:.2f}× | "
              f"{losses['budget'] == losses['packed']} ({losses['packed']:.6f}) |")


if __name__ == "__main__":
    main()
