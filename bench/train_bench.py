"""Trainer throughput, the input pipeline against sequential reads of the same files, and mtp vs eagle.

    .venv/bin/python bench/train_bench.py [--features runs/tiny/features] [--windows 3] [--rounds 5] [--steps 12]

Needs the tiny default's features (``mtp-train precompute recipes/tiny.yaml``). Measured in one run:

1. The input pipeline (``load_batch``, what the trainer calls: read + pack + convert to fp32) in bytes of stored
   features it reads per second, against a sequential read (8 MiB ``readinto`` a reused buffer) of the shard files
   those batches come from. The batches are those of the plan's first ``--windows`` shard windows (epoch 0, seed 0),
   so they read every row of those files; the pipeline also reads the next window ahead, and that I/O, wasted here,
   is inside its clock. Both from the same page-cache state, in interleaved rounds:
   - cold: every shard file is dropped from the page cache (``posix_fadvise(DONTNEED)``, no root needed; the
     resident fraction of the measured files is checked with ``mincore`` and printed) before each of the two
     measurements, and the reader forgets which windows it already read ahead;
   - warm: every shard file was just read, so both run from memory.
   Measured the same way, for comparison: the pipeline's reads alone (window readahead and positioned reads, no
   packing), and the per-sequence packing of two versions ago, without readahead (one
   ``reader.load`` per sequence, torch conversions and ``torch.cat``). Goal: pipeline / sequential >= 0.8.
   The machine is shared and noisy, so each ratio is given two ways: the median over rounds of the ratio to the
   sequential read right before it, and the best pipeline rate over the best sequential rate.
2. The trainer's loop (1-deep prefetch on a background thread, as ``mtp_train/train/trainer.py`` does) with the real
   mtp head, loss, backward and AdamW, starting from a cold page cache: how long each step waited for its batch.
3. If both heads were trained (``runs/tiny/heads/{mtp,eagle}``), their held-out top-1 per unrolled step and
   simulated tau, side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402
CHUNK = 8 << 20


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (works unprivileged for clean pages nobody has mapped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``), or None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page, cached, total = mmap.PAGESIZE, 0, 0
        for path in paths:
            size = path.stat().st_size
            with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                arr = np.frombuffer(mm, np.uint8)
                rc = libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
                del arr
                if rc != 0:
                    return None
                cached += sum(v & 1 for v in bytes(vec))
                total += pages
        return cached / max(total, 1)
    except (OSError, AttributeError):
        return None


def sequential_read(paths: list[Path], buf: bytearray) -> tuple[int, float]:
    """Bytes read and seconds taken to read the files start to end, 8 MiB at a time into one reused buffer."""
    view, nbytes = memoryview(buf), 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                nbytes += n
    return nbytes, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=Path, default=REPO / "runs/tiny/features")
    p.add_argument("--windows", type=int, default=3, help="shard windows (all their batches) per pipeline measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cache state")
    p.add_argument("--steps", type=int, default=12, help="training steps in the trainer-loop measurement")
    args = p.parse_args()
    print(machine_line(), flush=True)

    from mtp_train.heads import build_head, head_spec
    from mtp_train.heads.frozen import FrozenTarget
    from mtp_train.recipe import load_recipe
    from mtp_train.train.data import SHARD_WINDOW, load_batch, pack_per_sequence, plan_batches, plan_windows, read_ahead
    from mtp_train.train.loss import LossWeights, head_loss
    from mtp_train.features.reader import FeatureReader

    recipe = load_recipe(REPO / "recipes/tiny.yaml")
    batch_tokens = recipe.train.batch_tokens
    reader = FeatureReader(args.features)
    plan = plan_batches(reader.train, batch_tokens, 0, 0)
    measured = {s for w in plan_windows(reader.train, 0, 0)[: args.windows] for s in w}
    n_batches = next((k for k, ids in enumerate(plan) if reader.train[ids[0]].shard not in measured), len(plan))
    batches = [[reader.train[i] for i in ids] for ids in plan[:n_batches]]
    every_shard = sorted(args.features.glob("shard-*.safetensors"))
    files = sorted({args.features / r.shard for refs in batches for r in refs})
    names = ["input_ids", "loss_mask", "hidden"] + (["topk_logprobs", "topk_ids"] if reader.manifest.topk else [])
    row_bytes = {}
    for name in names:
        dtype, row = reader.row_layout(name)
        row_bytes[name] = dtype.itemsize * int(np.prod(row))
    tokens = sum(min(r.stop - r.start, batch_tokens) for refs in batches for r in refs)
    consumed = tokens * sum(row_bytes.values())  # bytes of stored features the pipeline reads
    reads = sum(len(refs) for refs in batches) * len(names)
    buf = bytearray(CHUNK)

    def pipeline(kind: str) -> float:
        """Seconds to load every batch. ``load_batch`` and its reads alone use the trainer's long-lived reader
        (shards already open); the per-sequence path memory-maps, so it gets a fresh reader, dropped afterwards
        so that the next eviction can drop its pages (pages mapped by a live mapping stay cached)."""
        r = reader if kind in ("new", "reads") else FeatureReader(args.features)
        r.reset_read_ahead()  # as a fresh run would: the first window is asked for again
        start = time.perf_counter()
        for refs in batches:
            if kind == "reads":  # the same readahead and positioned reads into the same buffers, without converting
                read_ahead(r, refs)
                lengths = [min(x.stop - x.start, batch_tokens) for x in refs]
                r.read_rows(refs, lengths, {k: staging[k][: sum(lengths) * row_bytes[k]] for k in names})
            else:
                (load_batch if kind == "new" else pack_per_sequence)(r, refs, batch_tokens, torch.float32)
        elapsed = time.perf_counter() - start
        del r
        gc.collect()
        return elapsed

    for refs in batches:  # open the shards and size the staging buffers, outside the clocks
        load_batch(reader, refs, batch_tokens, torch.float32)
    most = max(sum(min(x.stop - x.start, batch_tokens) for x in refs) for refs in batches)
    staging = {k: np.empty(most * row_bytes[k], np.uint8) for k in names}
    kinds = {"new": "pipeline: `load_batch` (read + pack + fp32)", "reads": "its reads alone, no packing",
             "old": "per-sequence packing, no readahead"}
    rows = {}  # (state, kind) -> list of bytes/s; (state, kind + "/seq") -> list of ratios to the adjacent seq read
    residency = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        for state in ("cold", "warm"):
            for kind in kinds:
                if state == "cold":
                    evict(every_shard)
                    residency[state].append(resident(files))
                    nbytes, t_seq = sequential_read(files, buf)
                    evict(every_shard)
                    residency[state].append(resident(files))
                else:
                    sequential_read(files, buf)  # warm up: every page of these files in memory
                    residency[state].append(resident(files))
                    nbytes, t_seq = sequential_read(files, buf)
                t_pipe = pipeline(kind)
                rows.setdefault((state, "seq"), []).append(nbytes / t_seq)
                rows.setdefault((state, kind), []).append(consumed / t_pipe)
                rows.setdefault((state, kind + "/seq"), []).append((consumed / t_pipe) / (nbytes / t_seq))

    # The trainer's loop: batch k+1 loads on one background thread while batch k trains (trainer.py's prefetch).
    frozen = FrozenTarget.load(recipe.target.path)
    torch.manual_seed(0)
    head = build_head(head_spec("mtp", 1, frozen.cfg, "bench"))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    weights = LossWeights(recipe.train.w_hidden, recipe.train.w_logits, recipe.train.unroll,
                          recipe.train.unroll_decay, recipe.train.teacher)
    steps = plan[n_batches : n_batches + args.steps]  # batches the pipeline measurements did not read
    loop_reader = FeatureReader(args.features)
    evict(every_shard)
    cold_at_start = resident(every_shard)
    waits, computes, loads, loop_tokens = [], [], [], 0
    prefetch = ThreadPoolExecutor(max_workers=1)

    def load(ids):
        def run():
            t0 = time.perf_counter()
            batch = load_batch(loop_reader, [loop_reader.train[i] for i in ids], batch_tokens, torch.float32)
            loads.append(time.perf_counter() - t0)
            return batch
        return run

    start = time.perf_counter()
    pending = prefetch.submit(load(steps[0]))
    for i in range(len(steps)):
        t0 = time.perf_counter()
        batch = pending.result()
        waits.append(time.perf_counter() - t0)
        pending = prefetch.submit(load(steps[i + 1])) if i + 1 < len(steps) else None
        t0 = time.perf_counter()
        loss, _ = head_loss(head, frozen, batch, weights)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        computes.append(time.perf_counter() - t0)
        loop_tokens += batch.num_tokens
    t_loop = time.perf_counter() - start
    prefetch.shutdown()

    def med(key):
        return statistics.median(rows[key])

    def mib(x):
        return f"{x / 2**20:,.0f}"

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    print(f"{len(batches)} batches of <= {batch_tokens} tokens, {tokens:,} tokens, {len(files)} shard files "
          f"({sum(f.stat().st_size for f in files) / 2**20:,.0f} MiB) in {args.windows} windows of {SHARD_WINDOW} "
          f"(of {len(every_shard)} shards), at most {max(len({r.shard for r in refs}) for refs in batches)} shards "
          f"per batch, {args.rounds} rounds per cache state")
    per_tensor = ", ".join(f"{k} {v}" for k, v in row_bytes.items())
    print(f"pipeline reads {sum(row_bytes.values())} bytes/token ({per_tensor}), {reads / len(batches):.0f} "
          f"positioned reads per batch of {consumed / reads / 1024:.1f} KiB on average")
    cold, warm = residency["cold"], residency["warm"]
    print("shard pages in the page cache before each measurement (mincore): cold at most "
          f"{pct(None if None in cold else max(cold))}, warm at least {pct(None if None in warm else min(warm))}\n")
    print("| page cache | what | MiB/s: median, best | / sequential: median of rounds (each round) | best / best |\n"
          "|---|---|---:|---:|---:|")
    for state in ("cold", "warm"):
        seq = rows[(state, "seq")]
        print(f"| {state} | sequential read of the {len(files)} shard files | {mib(med((state, 'seq')))}, {mib(max(seq))} "
              f"| 1 | 1 |")
        for kind, label in kinds.items():
            each = ", ".join(f"{x:.2f}" for x in rows[(state, kind + "/seq")])
            value = f"{med((state, kind + '/seq')):.2f}"
            best = f"{max(rows[(state, kind)]) / max(seq):.2f}"
            if kind == "new":
                value, best = f"**{value}**", f"**{best}**"
            print(f"| {state} | {label} | {mib(med((state, kind)))}, {mib(max(rows[(state, kind)]))} | {value} ({each}) "
                  f"| {best} |")
    later = waits[1:]
    print(f"\ntrainer loop from a cold page cache (resident {pct(cold_at_start)}), {len(steps)} steps, "
          f"{loop_tokens:,} tokens, mtp head, unroll {recipe.train.unroll}:\n")
    print("| what | value |\n|---|---:|")
    print(f"| training, including waits | {loop_tokens / t_loop:,.0f} tok/s |")
    print(f"| compute per step (loss, backward, AdamW), median | {statistics.median(computes) * 1e3:,.0f} ms |")
    print(f"| load per batch on the prefetch thread (cold, while the step computes), median / max | "
          f"{statistics.median(loads) * 1e3:.1f} ms / {max(loads) * 1e3:.1f} ms |")
    print(f"| wait for the first batch (nothing to overlap it with) | {waits[0] * 1e3:.1f} ms |")
    if later:
        print(f"| wait for the batch, steps 2-{len(steps)}: max / total | {max(later) * 1e3:.2f} ms / "
              f"{sum(later) * 1e3:.2f} ms |")
        print(f"| share of the loop spent waiting for data after step 1 | {sum(later) / t_loop:.3%} |")

    heads = {k: REPO / "runs/tiny/heads" / k / "config.json" for k in ("mtp", "eagle")}
    if all(p.is_file() for p in heads.values()):
        print("\n| head | steps | held-out top-1 per unrolled step | simulated tau |\n|---|---:|---|---:|")
        for kind, path in heads.items():
            cfg = json.loads(path.read_text())
            v = cfg["validation"]
            print(f"| {kind} | {cfg['steps']} | {', '.join(f'{a:.3f}' for a in v['val_top1'])} | {v['val_tau']:.3f} |")


if __name__ == "__main__":
    main()
