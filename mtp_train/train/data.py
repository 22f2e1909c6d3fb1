"""Token-budget batches of packed feature sequences, in a seeded order that a checkpoint can resume."""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from mtp_train.io import group_by_tokens
from mtp_train.features.reader import FeatureReader, SequenceRef


@dataclass
class Batch:
    """Packed documents: ``tokens [N]`` int64, ``hidden [N, H]`` float (last layer, pre-norm),
    ``loss_mask [N]`` bool, ``topk_logprobs [N, K]`` float, ``topk_ids [N, K]`` int64, ``tail_logprob [N]``
    float32 (log of the mass outside the top-K, exact) and ``cu_seqlens`` (Python list, D+1 offsets). Row t's
    top-K is the target's distribution of token t+1. ``aux [N, A*H]``: the outputs of A other stored layers,
    concatenated in stored order, when asked for (an ``eagle3`` head's input), else None.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    loss_mask: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    tail_logprob: torch.Tensor
    cu_seqlens: list[int]
    aux: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def to(self, device: torch.device) -> Batch:
        """The same batch with its tensors on ``device`` (``cu_seqlens`` stays a list)."""
        if self.tokens.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.tokens), move(self.hidden), move(self.loss_mask), move(self.topk_logprobs),
                     move(self.topk_ids), move(self.tail_logprob), self.cu_seqlens,
                     None if self.aux is None else move(self.aux))


# Shards per shuffle window. Each epoch visits the shards in a seeded order, W at a time; a window's sequences are
# shuffled among themselves and cut into batches, so a batch draws on at most W shard files and the loader can read
# each window's files whole and in order, one window ahead (``load_batch``), instead of scattered rows from every
# shard. Memory: about two windows of shard files in the page cache. A dataset with fewer shards than W is one window
# per epoch, a global shuffle.
SHARD_WINDOW = 4


def plan_windows(refs: list[SequenceRef], seed: int, epoch: int) -> list[list[str]]:
    """The shard files of each window of one epoch, in visiting order (a seeded permutation of the shards, cut
    into consecutive runs of ``SHARD_WINDOW``)."""
    shards = list(dict.fromkeys(r.shard for r in refs))
    perm = torch.randperm(len(shards), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    order = [shards[i] for i in perm]
    return [order[i : i + SHARD_WINDOW] for i in range(0, len(order), SHARD_WINDOW)]


def plan_batches(refs: list[SequenceRef], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices into ``refs`` for each batch of one epoch: window by window (``plan_windows``), a seeded shuffle of
    the window's sequences cut greedily by ``batch_tokens``; no batch spans two windows.

    Also records, for ``load_batch``, which window each batch belongs to and which comes next (the first window of
    the next epoch after the last), so that it can ask for whole shard files ahead of their rows.
    """
    windows = plan_windows(refs, seed, epoch)
    after = windows[1:] + plan_windows(refs, seed, epoch + 1)[:1]  # what each window's successor is
    gen = torch.Generator().manual_seed((seed * 1000 + epoch) * 7919 + 1)
    by_shard: dict[str, list[int]] = {}
    for i, r in enumerate(refs):
        by_shard.setdefault(r.shard, []).append(i)
    plan, ahead = [], {}
    for w, shards in enumerate(windows):
        members = [i for s in shards for i in by_shard[s]]
        order = [members[j] for j in torch.randperm(len(members), generator=gen).tolist()]
        lengths = [min(refs[i].stop - refs[i].start, batch_tokens) for i in order]
        readahead = tuple(dict.fromkeys(shards + after[w]))
        for group in group_by_tokens(lengths, batch_tokens):
            plan.append([order[j] for j in group])
            ahead[refs[plan[-1][0]]] = readahead
    global _readahead
    _readahead = ahead
    return plan


# The latest plan's batches, by their first sequence: shard files of the batch's window and of the next window.
_readahead: dict[SequenceRef, tuple[str, ...]] = {}


def read_ahead(reader: FeatureReader, refs: list[SequenceRef]) -> None:
    """If ``refs`` is a batch of the latest ``plan_batches``, hand its window's and the next window's shard files
    to ``reader.read_ahead`` (read whole in the background; a no-op for files already asked for). Other batches
    (validation's) ask for nothing."""
    ahead = _readahead.get(refs[0]) if refs else None
    if ahead is not None:
        reader.read_ahead(ahead)


def load_batch(reader: FeatureReader, refs: list[SequenceRef], batch_tokens: int, dtype: torch.dtype,
               every_token: bool = False, aux: tuple[int, ...] = ()) -> Batch:
    """Read and pack ``refs`` (each cut to ``batch_tokens``); the last stored layer is the head's input, and the
    stored layers at indices ``aux`` (into ``manifest.layers``) fill ``Batch.aux``.
    ``every_token`` replaces the stored loss mask by all ones (``train.loss_tokens: all``).

    Each tensor is read for the whole batch at once (one positioned read per sequence, into a buffer this thread
    reuses) and converted once into a new tensor, with numpy on this thread only: the trainer's prefetch thread
    never enters torch's intra-op pool that the training step is using. The result is bit for bit what packing
    ``reader.load(ref)`` sequence by sequence with torch's conversions gives.

    For a batch of the latest ``plan_batches``, the shard files of its window and of the next one are first handed
    to ``reader.read_ahead`` (whole-file readahead in the background, once per window), so that from the second
    window on its rows come from the page cache while the disk reads the next window sequentially.
    """
    lengths = [min(r.stop - r.start, batch_tokens) for r in refs]
    cu = [0, *itertools.accumulate(lengths)]
    n = cu[-1]
    k = reader.manifest.topk
    names = ["input_ids", "loss_mask", "hidden"] + (["topk_logprobs", "topk_ids", "tail_logprob"] if k else [])
    layout = {name: reader.row_layout(name) for name in names}
    raw = {name: _staging(name, n * stored.itemsize * math.prod(row)) for name, (stored, row) in layout.items()}
    read_ahead(reader, refs)
    reader.read_rows(refs, lengths, raw)

    def convert(name: str, to: torch.dtype, layers: int | list[int] | None = None) -> torch.Tensor:
        stored, row = layout[name]
        src = raw[name].view(_NUMPY[stored]).reshape(n, *row)
        return _convert(stored, src if layers is None else src[:, layers], to)

    return Batch(
        tokens=convert("input_ids", torch.long),
        hidden=convert("hidden", dtype, -1),
        loss_mask=torch.ones(n, dtype=torch.bool) if every_token else convert("loss_mask", torch.bool),
        topk_logprobs=convert("topk_logprobs", dtype) if k else torch.zeros(n, 0),
        topk_ids=convert("topk_ids", torch.long) if k else torch.zeros(n, 0, dtype=torch.long),
        tail_logprob=convert("tail_logprob", torch.float32) if k else torch.zeros(n),
        cu_seqlens=cu,
        aux=convert("hidden", dtype, list(aux)).reshape(n, -1) if aux else None,
    )


def pack_per_sequence(reader: FeatureReader, refs: list[SequenceRef], batch_tokens: int, dtype: torch.dtype) -> Batch:
    """The straightforward packing ``load_batch`` must equal bit for bit: one ``reader.load`` per sequence, torch's
    conversions, ``torch.cat``. Kept as its reference (tests) and its baseline (``bench/train_bench.py``)."""
    parts = [reader.load(r) for r in refs]
    cut = [min(int(p["input_ids"].numel()), batch_tokens) for p in parts]
    cu = [0, *itertools.accumulate(cut)]

    def cat(name: str, fn) -> torch.Tensor:
        return torch.cat([fn(p[name][:n]) for p, n in zip(parts, cut)])

    k = reader.manifest.topk
    return Batch(
        tokens=cat("input_ids", lambda t: t.long()),
        hidden=cat("hidden", lambda t: t[:, -1].to(dtype)),
        loss_mask=cat("loss_mask", lambda t: t.bool()),
        topk_logprobs=cat("topk_logprobs", lambda t: t.to(dtype)) if k else torch.zeros(cu[-1], 0),
        topk_ids=cat("topk_ids", lambda t: t.long()) if k else torch.zeros(cu[-1], 0, dtype=torch.long),
        tail_logprob=cat("tail_logprob", lambda t: t.float()) if k else torch.zeros(cu[-1]),
        cu_seqlens=cu,
    )


# Stored dtypes as numpy sees their bytes (numpy has no bfloat16: its bits are a uint16).
_NUMPY = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint8: np.uint8}
# Conversions where numpy's cast is exactly torch's (exact widening, nonzero -> True, plain copies).
_NUMPY_CASTS = {(torch.int32, torch.int64), (torch.uint8, torch.bool), (torch.float16, torch.float32)} | {
    (t, t) for t in (torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8)}
_buffers = threading.local()


def _staging(name: str, nbytes: int) -> np.ndarray:
    """This thread's raw read buffer for tensor ``name``: reused across batches, so that reads land in memory that
    is already paged in (a fresh buffer per batch costs more in page faults than the copy itself)."""
    bufs = _buffers.__dict__
    buf = bufs.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = bufs[name] = np.empty(nbytes, np.uint8)
    return buf[:nbytes]


def _convert(stored: torch.dtype, src: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous ``dtype`` tensor holding ``src`` (values of ``stored``), converted as ``Tensor.to`` does."""
    out = torch.empty(src.shape, dtype=dtype)
    if stored == torch.bfloat16 and dtype == torch.float32:
        # bf16 is the top half of an fp32, so widening is a 16-bit shift: the same bits torch produces.
        np.left_shift(src, 16, out=out.numpy().view(np.uint32), dtype=np.uint32)
    elif (stored, dtype) in _NUMPY_CASTS:
        np.copyto(out.numpy(), src, casting="unsafe")
    else:
        out.copy_(torch.from_numpy(src).view(stored))
    return out
