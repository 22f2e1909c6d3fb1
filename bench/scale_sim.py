"""Scale simulation of the features format: 10M conversations written by 64 array tasks, read by 8 training ranks.

Writes a features directory whose shards are sparse files with real safetensors headers (the shapes of a Llama-3.1-8B
recipe: one stored layer of 4,096, top-64, about 1M tokens per shard; the tensors' bytes are holes), and the ranks'
manifests and indexes with the project's own ``Manifest``, ``RankIndex``, ``save_rank`` and ``merge_manifests``.
Then it starts the ranks as separate processes, at once, each doing what the trainer's data start-up does (open the
features with ``FeatureReader``, plan the epoch to size it, plan its own batches), and prints the manifest's and
indexes' size on disk, the manifest read time, each rank's start-up time and peak RSS, and pass/fail against the
goals. The directory is removed afterwards.

    .venv/bin/python bench/scale_sim.py [--conversations 10000000] [--tasks 64] [--ranks 8] [--dir /tmp]
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import machine_line  # noqa: E402

GOALS = {"startup_s": 60.0, "rss_gib": 2.0, "manifest_read_s": 10.0}
HIDDEN, LAYERS, TOPK = 4096, 1, 64  # recipes/llama3.1-8b.yaml's features
SHARD_TOKENS, BATCH_TOKENS = 1 << 20, 32768


def sparse_shard(path: Path, tokens: np.ndarray, row_ids: np.ndarray) -> int:
    """A shard file of ``tokens [S]`` sequences with the real tensors' header and holes for their bytes; its size."""
    t, s = int(tokens.sum()), len(tokens)
    shapes = {"input_ids": ("I32", [t]), "loss_mask": ("U8", [t]), "cu_seqlens": ("I64", [s + 1]),
              "hidden": ("BF16", [t, LAYERS, HIDDEN]), "logsumexp": ("F32", [t]), "topk_logprobs": ("BF16", [t, TOPK]),
              "topk_ids": ("I32", [t, TOPK]), "tail_logprob": ("F32", [t])}
    size = {"I32": 4, "U8": 1, "I64": 8, "BF16": 2, "F32": 4}
    header: dict = {"__metadata__": {"format_version": "1", "row_ids": json.dumps(row_ids.tolist())}}
    at = 0
    for name, (dtype, shape) in sorted(shapes.items()):
        n = size[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + at)
    return 8 + len(raw) + at


def write_task(root: Path, task: int, tasks: int, conversations: int, lengths: np.ndarray) -> None:
    """Array task ``task``'s shards, index and complete manifest, as precompute leaves them."""
    from mtp_train.features.index import RankIndex
    from mtp_train.features.manifest import Manifest, ShardEntry, shard_name
    from mtp_train.precompute.shards import save_rank

    lo, hi = task * conversations // tasks, (task + 1) * conversations // tasks
    rows = np.arange(lo, hi, dtype=np.int64)
    mine = lengths[lo:hi]
    shard_of = (np.cumsum(mine) - 1) // SHARD_TOKENS
    cuts = np.flatnonzero(np.diff(shard_of)) + 1
    manifest = Manifest(ranks=[task], world_size=tasks, complete=True, fingerprint={"target": "sim"},
                        settings={}, layers=[31], hidden_size=HIDDEN, topk=TOPK, num_rows=len(rows),
                        heldout_row_ids=[int(r) for r in rows[:: max(1, len(rows) // 4)][:4]])
    index = RankIndex(rows, [], [])
    for s, (r, t) in enumerate(zip(np.split(rows, cuts), np.split(mine, cuts))):
        name = shard_name(task, s)
        size = sparse_shard(root / name, t, r)
        index.add(r, t)
        manifest.shards.append(ShardEntry(file=name, rank=task, num_seqs=len(r), num_tokens=int(t.sum()),
                                          sha256="0" * 64, bytes=size))
    save_rank(root, task, manifest, index)


def rank_child(root: Path, rank: int, world: int) -> None:
    """One training rank's data start-up, timed from this process's start; prints one JSON line."""
    from mtp_train.features.reader import FeatureReader
    from mtp_train.train.data import plan_batches, plan_rank

    reader = FeatureReader(root)
    per_epoch = len(plan_batches(reader.train, BATCH_TOKENS, 0, 0)) // world  # as Trainer.setup sizes the epoch
    plan, = plan_rank(reader.train, BATCH_TOKENS, 0, 0, rank, world, 1)
    shards = np.unique(reader.train.shard[plan.order])
    print(json.dumps({"rank": rank, "startup_s": time.perf_counter() - _STARTED, "batches": len(plan),
                      "per_epoch": per_epoch, "shards_read": len(shards), "sequences": len(reader.sequences),
                      "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=10_000_000)
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--rank-child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_child is not None:
        return rank_child(args.root, args.rank_child, args.ranks)
    print(machine_line(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="scale-sim-", dir=args.dir))
    try:
        simulate(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def simulate(root: Path, args: argparse.Namespace) -> None:
    from mtp_train.features.index import load_indexes
    from mtp_train.features.verify import load_features_manifest
    from mtp_train.precompute.directory import merge_manifests

    lengths = np.random.default_rng(0).integers(64, 1937, args.conversations).astype(np.int64)  # mean 1,000
    began = time.perf_counter()
    for task in range(args.tasks):
        write_task(root, task, args.tasks, args.conversations, lengths)
    wrote = time.perf_counter() - began
    began = time.perf_counter()
    merge_manifests(root, args.tasks)
    merged = time.perf_counter() - began
    began = time.perf_counter()
    manifest = load_features_manifest(root)
    manifest_s = time.perf_counter() - began
    load_indexes(root, manifest)
    index_s = time.perf_counter() - began - manifest_s
    files = list(root.iterdir())
    shards = [f for f in files if f.name.startswith("shard-")]
    mib = lambda fs: sum(f.stat().st_size for f in fs) / 2**20  # noqa: E731
    on_disk = sum(f.stat().st_blocks * 512 for f in files) / 2**20
    print(f"{args.conversations:,} conversations ({int(lengths.sum()):,} tokens), {args.tasks} array tasks, "
          f"{len(shards):,} shards ({mib(shards) / 2**20:,.1f} TiB apparent, {on_disk:,.0f} MiB on disk); "
          f"written in {wrote:.0f} s, merged in {merged:.1f} s")
    print(f"manifest.json: {(root / 'manifest.json').stat().st_size / 2**20:.2f} MiB, read in {manifest_s:.2f} s; "
          f"indexes: {mib(root.glob('index.rank-*.safetensors')):.1f} MiB in {args.tasks} files, read in "
          f"{index_s:.2f} s; rank manifests: {mib(root.glob('manifest.rank-*.json')):.2f} MiB")
    results = start_ranks(root, args.ranks)
    for r in results:
        print(f"rank {r['rank']}: start-up {r['startup_s']:.1f} s, peak RSS {r['rss_gib']:.2f} GiB, "
              f"{r['batches']:,} batches of {BATCH_TOKENS:,} tokens from {r['shards_read']:,} shards "
              f"(epoch: {r['per_epoch']:,} steps), {r['sequences']:,} sequences indexed")
    checks = {"startup_s": max(r["startup_s"] for r in results), "rss_gib": max(r["rss_gib"] for r in results),
              "manifest_read_s": manifest_s + index_s}
    for name, value in checks.items():
        print(f"{name}: {value:.2f} (goal < {GOALS[name]}): {'PASS' if value < GOALS[name] else 'FAIL'}")


def start_ranks(root: Path, ranks: int) -> list[dict]:
    """The ranks' start-ups, run at once as separate processes."""
    cmd = [sys.executable, __file__, "--root", str(root), "--ranks", str(ranks), "--rank-child"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd + [str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(ranks)]
    out = [proc.communicate()[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a rank failed: {[proc.returncode for proc in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in out]


if __name__ == "__main__":
    main()
