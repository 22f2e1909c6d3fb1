"""Trainer throughput, the input pipeline against sequential disk reads, and mtp vs eagle.

    .venv/bin/python bench/train_bench.py [--features runs/tiny/features] [--batches 20]

Needs the tiny default's features (``mtp-train precompute recipes/tiny.yaml``). Measured in one run:

1. Sequential read bandwidth of the shard files (8 MiB reads), and the input pipeline alone
   (``load_batch``: memory-mapped slices, packing) in bytes of features per second. Goal: >= 0.8.
2. Training steps (loss, backward, AdamW) in tokens/s, and the share of a step spent loading data.
3. If both heads were trained (``runs/tiny/heads/{mtp,eagle}``), their held-out top-1 per unrolled
   step and simulated tau, side by side.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=Path, default=REPO / "runs/tiny/features")
    p.add_argument("--batches", type=int, default=20)
    args = p.parse_args()

    from mtp_train.heads import build_head, head_spec
    from mtp_train.heads.frozen import FrozenTarget
    from mtp_train.recipe import load_recipe
    from mtp_train.train.data import load_batch, plan_batches
    from mtp_train.train.loss import LossWeights, head_loss
    from precompute.reader import FeatureReader

    recipe = load_recipe(REPO / "recipes/tiny.yaml")
    reader = FeatureReader(args.features)
    batches = plan_batches(reader.train, recipe.train.batch_tokens, 0, 0)[: args.batches]

    files = sorted({reader.sequences[0].shard} | {e.file for e in reader.manifest.shards[:4]})
    start, nbytes = time.perf_counter(), 0
    for name in files:
        with open(args.features / name, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                nbytes += len(chunk)
    disk = nbytes / (time.perf_counter() - start)

    per_token = reader.manifest.total_bytes / reader.manifest.total_tokens
    start, tokens = time.perf_counter(), 0
    loaded = []
    for ids in batches:
        b = load_batch(reader, [reader.train[i] for i in ids], recipe.train.batch_tokens, torch.float32)
        tokens += b.num_tokens
        loaded.append(b)
    t_load = time.perf_counter() - start
    pipeline = tokens * per_token / t_load

    frozen = FrozenTarget.load(recipe.target.path)
    torch.manual_seed(0)
    head = build_head(head_spec("mtp", 1, frozen.cfg, "bench"))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    weights = LossWeights(recipe.train.w_hidden, recipe.train.w_logits, recipe.train.unroll,
                          recipe.train.unroll_decay, recipe.train.teacher)
    start = time.perf_counter()
    for b in loaded:
        loss, _ = head_loss(head, frozen, b, weights)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    t_train = time.perf_counter() - start

    print(f"{len(batches)} batches of <= {recipe.train.batch_tokens} tokens, {tokens:,} tokens, "
          f"{per_token:.0f} feature bytes/token, unroll {recipe.train.unroll}\n")
    print("| what | value |\n|---|---:|")
    print(f"| sequential read of {len(files)} shard files | {disk / 2**20:,.0f} MiB/s |")
    print(f"| input pipeline alone (read + pack) | {pipeline / 2**20:,.0f} MiB/s ({tokens / t_load:,.0f} tok/s) |")
    print(f"| pipeline / disk | {pipeline / disk:.2f} |")
    print(f"| training steps, mtp head | {tokens / t_train:,.0f} tok/s |")
    print(f"| data loading share of a step | {t_load / (t_load + t_train):.1%} |")

    heads = {k: REPO / "runs/tiny/heads" / k / "config.json" for k in ("mtp", "eagle")}
    if all(p.is_file() for p in heads.values()):
        print("\n| head | steps | held-out top-1 per unrolled step | simulated tau |\n|---|---:|---|---:|")
        for kind, path in heads.items():
            cfg = json.loads(path.read_text())
            v = cfg["validation"]
            print(f"| {kind} | {cfg['steps']} | {', '.join(f'{a:.3f}' for a in v['val_top1'])} | {v['val_tau']:.3f} |")


if __name__ == "__main__":
    main()
