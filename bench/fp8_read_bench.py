"""FP8 against bf16 features as the trainer's loader reads them, side by side in one run.

    .venv/bin/python bench/fp8_read_bench.py [--hidden 8192] [--topk 64] [--batch-tokens 16384] [--shards 6]
        [--repeats 5] [--dir /tmp]

Writes two features folders of the same random rows (a 70B target's sizes by default: one stored layer of 8,192,
top-64, sequences of 1,024 tokens, shards of one batch each), one storing bf16 hidden states and one e4m3 values
with their scales (``quantize_fp8``, as precompute stores them), with the project's manifest and index. Then, with
the files in the page cache (read once first), it times on this thread, alternating the two in each repeat
(median of ``--repeats``):

- ``load_batch``: every batch of an epoch's plan, packed with a float32 hidden state as the trainer loads it;
- the hidden state's conversion alone, for one batch: bf16's widening, the fast e4m3 dequantizer, and the
  256-entry table it replaced (``FP8_VALUES[bits] * scale``), each into a new tensor as the loader converts; and
  the first two into a buffer whose pages are already in (``touched``: the conversion without the page faults).

It prints its machine first, then milliseconds per batch and each one's ratio to bf16's. The folders are removed
afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import machine_line  # noqa: E402
from mtp_train.features.index import RankIndex  # noqa: E402
from mtp_train.features.manifest import Manifest, ShardEntry, shard_name  # noqa: E402
from mtp_train.features.reader import FeatureReader  # noqa: E402
from mtp_train.features.tensors import FP8_VALUES, HIDDEN_DTYPES, dequantize_fp8_numpy, quantize_fp8  # noqa: E402
from mtp_train.precompute.shards import save_rank  # noqa: E402
from mtp_train.train.data import load_batch, plan_batches  # noqa: E402

SEQ_TOKENS = 1024


def random_shard(shard: int, tokens: int, hidden: int, topk: int) -> dict[str, dict[str, torch.Tensor]]:
    """One shard's tensors in bf16 and in fp8 (the same float32 rows behind both), by hidden dtype."""
    g = torch.Generator().manual_seed(shard)
    rows = torch.randn(tokens, 1, hidden, generator=g) * torch.rand(tokens, 1, 1, generator=g).mul(8).exp()
    common = {"input_ids": torch.randint(0, 128256, (tokens,), generator=g, dtype=torch.int32),
              "loss_mask": torch.ones(tokens, dtype=torch.uint8),
              "cu_seqlens": torch.arange(0, tokens + 1, SEQ_TOKENS, dtype=torch.int64),
              "logsumexp": torch.randn(tokens, generator=g),
              "topk_logprobs": torch.randn(tokens, topk, generator=g).to(torch.bfloat16),
              "topk_ids": torch.randint(0, 128256, (tokens, topk), generator=g, dtype=torch.int32),
              "tail_logprob": torch.randn(tokens, generator=g)}
    values, scale = quantize_fp8(rows)
    return {"bf16": {**common, "hidden": rows.to(torch.bfloat16)},
            "fp8": {**common, "hidden": values, "hidden_scale": scale}}


def write_features(root: Path, shards: int, tokens: int, hidden: int, topk: int) -> dict[str, Path]:
    """Both folders, ``root/bf16`` and ``root/fp8``: ``shards`` shards of ``tokens`` tokens, one rank's."""
    dirs = {dtype: root / dtype for dtype in HIDDEN_DTYPES}
    seqs = tokens // SEQ_TOKENS
    manifests, indexes = {}, {}
    for dtype, d in dirs.items():
        d.mkdir(parents=True)
        manifests[dtype] = Manifest(ranks=[0], world_size=1, complete=True, fingerprint={"target": "bench"},
                                    settings={}, layers=[79], hidden_size=hidden, hidden_dtype=HIDDEN_DTYPES[dtype],
                                    topk=topk, num_rows=shards * seqs, heldout_row_ids=[])
        indexes[dtype] = RankIndex(np.arange(shards * seqs, dtype=np.int64), [], [])
    for s in range(shards):
        rows = list(range(s * seqs, (s + 1) * seqs))
        for dtype, tensors in random_shard(s, tokens, hidden, topk).items():
            path = dirs[dtype] / shard_name(0, s)
            save_file(tensors, path, metadata={"format_version": "1", "row_ids": json.dumps(rows)})
            indexes[dtype].add(rows, [SEQ_TOKENS] * seqs)
            manifests[dtype].shards.append(ShardEntry(file=path.name, rank=0, num_seqs=seqs, num_tokens=tokens,
                                                      sha256="", bytes=path.stat().st_size))
    for dtype, d in dirs.items():
        save_rank(d, 0, manifests[dtype], indexes[dtype])
    return dirs


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def conversions(fp8: FeatureReader, bf16: FeatureReader, refs, batch_tokens: int) -> dict[str, callable]:
    """The hidden state's conversion of one batch, alone: its raw rows read once, converted as ``load_batch`` does."""
    n = sum(min(r.stop - r.start, batch_tokens) for r in refs)
    hidden = fp8.manifest.hidden_size
    raw = {"hidden": np.empty(n * hidden, np.uint8), "hidden_scale": np.empty(n * 4, np.uint8)}
    fp8.read_rows(refs, [r.stop - r.start for r in refs], raw)
    bits, scale = raw["hidden"].reshape(n, hidden), raw["hidden_scale"].view(np.float32)
    wide = {"hidden": np.empty(n * hidden * 2, np.uint8)}
    bf16.read_rows(refs, [r.stop - r.start for r in refs], wide)
    half = wide["hidden"].view(np.uint16).reshape(n, hidden)

    touched = np.ones((n, hidden), np.float32)  # a buffer whose pages are in: the conversion without first touch

    def widen(out=None):
        out = torch.empty((n, hidden), dtype=torch.float32).numpy() if out is None else out
        np.left_shift(half, 16, out=out.view(np.uint32), dtype=np.uint32)

    def fast(out=None):
        dequantize_fp8_numpy(bits, scale, out=torch.empty((n, hidden), dtype=torch.float32).numpy()
                             if out is None else out)

    def table():
        out = FP8_VALUES[bits]
        out *= scale[:, None]

    return {"bf16 widening": widen, "fp8 fast dequantizer": fast, "fp8 table (before)": table,
            "bf16 widening, touched": lambda: widen(touched), "fp8 dequantizer, touched": lambda: fast(touched)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    print(machine_line(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="fp8-read-bench-", dir=args.dir))
    try:
        dirs = write_features(root, args.shards, args.batch_tokens, args.hidden, args.topk)
        readers = {dtype: FeatureReader(d) for dtype, d in dirs.items()}
        plan = plan_batches(readers["bf16"].train, args.batch_tokens, 0, 0)
        batches = [[readers["bf16"].train[i] for i in ids] for ids in plan]
        loads = {dtype: (lambda r=r: [load_batch(r, refs, args.batch_tokens, torch.float32) for refs in batches])
                 for dtype, r in readers.items()}
        jobs = {f"load_batch, {dtype}": fn for dtype, fn in loads.items()}
        jobs |= conversions(readers["fp8"], readers["bf16"], batches[0], args.batch_tokens)
        for fn in loads.values():
            fn()  # the files into the page cache, the buffers paged in
        times: dict[str, list[float]] = {name: [] for name in jobs}
        for r in range(args.repeats):
            for name, fn in (list(jobs.items()) if r % 2 == 0 else list(jobs.items())[::-1]):
                times[name].append(timed(fn) / (len(batches) if name.startswith("load_batch") else 1))
        report(times, args, len(batches))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(times: dict[str, list[float]], args: argparse.Namespace, batches: int) -> None:
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"features of hidden {args.hidden}, one layer, top-{args.topk}; batches of {args.batch_tokens:,} tokens "
          f"({batches} per run), float32 hidden; page cache warm; median of {args.repeats} alternated repeats")
    print(f"{'':28s} {'ms/batch':>9s} {'tokens/s':>12s} {'vs bf16':>8s}  (touched: vs bf16's touched)")
    for name, t in ms.items():
        ref = ms["load_batch, bf16" if name.startswith("load_batch") else
                 "bf16 widening, touched" if name.endswith("touched") else "bf16 widening"]
        print(f"{name:28s} {t:9.1f} {args.batch_tokens / t * 1e3:12,.0f} {t / ref:7.2f}x")
    print(f"fast dequantizer against the table it replaced: {ms['fp8 table (before)'] / ms['fp8 fast dequantizer']:.2f}x "
          "faster")


if __name__ == "__main__":
    main()
