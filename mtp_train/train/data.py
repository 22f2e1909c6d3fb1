"""Token-budget batches of packed feature sequences, in a seeded order that a checkpoint can resume."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mtp_train.features.online import Features
from mtp_train.features.reader import FeatureReader, SequenceRef, SequenceTable, stored_names
from mtp_train.features.tensors import FP8, dequantize_fp8, dequantize_fp8_numpy


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
# shard. A dataset with fewer shards than W is one window per epoch, a global shuffle. With several ranks, each rank
# takes its own windows (``plan_batches``).
SHARD_WINDOW = 4
# The most page cache one training rank asks to be read ahead at once: whole shard files, in the order a batch names
# them (its window's, then the next window's), as many as fit. Where SLURM caps a job's memory the page cache counts
# against the cap, so the train job's ``--mem`` counts this (``mtp_train.host_plan``), else the kernel would evict
# pages read ahead before their rows are read. Shards larger than this (1M tokens of a 70B target: 16 GiB) are not
# read ahead: their sequences are reads of tens of MB each, which the disk serves at its sequential rate anyway.
READ_AHEAD_BYTES = 8 * 2**30


def read_ahead_bytes(shard_bytes: int, lanes: int) -> int:
    """The most bytes one rank's loader asks the page cache for at once (``READ_AHEAD_BYTES``' whole shards), for
    shards of at most ``shard_bytes`` and ``lanes`` micro-batch lanes (each naming its window and the next)."""
    return min(2 * SHARD_WINDOW * lanes, READ_AHEAD_BYTES // max(shard_bytes, 1)) * shard_bytes


def plan_windows(refs: SequenceTable, seed: int, epoch: int) -> list[list[str]]:
    """The shard files of each window of one epoch, in visiting order (a seeded permutation of the shards, cut
    into consecutive runs of ``SHARD_WINDOW``)."""
    ids, first = np.unique(refs.shard, return_index=True)
    shards = [refs.names[i] for i in ids[np.argsort(first)]]
    perm = torch.randperm(len(shards), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    order = [shards[i] for i in perm]
    return [order[i : i + SHARD_WINDOW] for i in range(0, len(order), SHARD_WINDOW)]


class BatchPlan:
    """One lane's batches of one epoch: batch ``b`` is ``order[bounds[b]:bounds[b + 1]]``, indices into the
    planned sequences (``order [n]`` int64, ``bounds [B+1]`` int64); ``plan[b]`` is that list of ints. ``keys[b]``
    names batch ``b`` for ``read_ahead``, ``ahead[b]`` lists the shard files to read ahead of it and ``window[b]``
    the shard files of its window (those online training scores for it)."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, keys: list[tuple], ahead: list[tuple[str, ...]],
                 window: list[tuple[str, ...]]) -> None:
        self.order, self.bounds, self.keys, self.ahead, self.window = order, bounds, keys, ahead, window

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, b: int | slice) -> list[int] | list[list[int]]:
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        if not -len(self) <= b < len(self):
            raise IndexError(b)
        b %= len(self)
        return self.order[self.bounds[b] : self.bounds[b + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[b] for b in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BatchPlan) and np.array_equal(self.order, other.order)
                and np.array_equal(self.bounds, other.bounds))


def plan_batches(refs: SequenceTable, batch_tokens: int, seed: int, epoch: int, lane: int = 0, lanes: int = 1
                 ) -> BatchPlan:
    """Lane ``lane`` of ``lanes``'s batches of one epoch, as indices into ``refs``: window by window
    (``plan_windows``), a seeded shuffle of the window's sequences cut greedily by ``batch_tokens``; no batch spans
    two windows. Each lane takes every ``lanes``-th window (so whoever reads a lane reads only its shard files), or,
    when there are fewer windows than lanes, every ``lanes``-th batch of them all. The lanes' plans together are the
    plan of ``lanes = 1``; they may differ in length by a few batches (the trainer wraps around).

    Also records, for ``load_batch``, which shard files each batch's window and the lane's next window hold, so that
    it can ask for whole shard files ahead of their rows (``plan_rank`` records a rank's lanes together).
    """
    windows = plan_windows(refs, seed, epoch)
    split = 1 < lanes <= len(windows)
    mine = list(range(lane, len(windows), lanes)) if split else list(range(len(windows)))
    following = plan_windows(refs, seed, epoch + 1)
    after = [windows[w] for w in mine[1:]] + following[lane if split else 0 :][:1]  # what this lane reads next
    members = _by_shard(refs)
    lengths = np.minimum(refs.lengths, batch_tokens)
    orders, cuts, keys, ahead, window = [], [np.zeros(1, np.int64)], [], [], []
    for w, later in zip(mine, after):
        idx = np.concatenate([members[s] for s in windows[w]])
        gen = torch.Generator().manual_seed(((seed * 1000 + epoch) * 7919 + 1) * 100_003 + w)
        idx = idx[torch.randperm(len(idx), generator=gen).numpy()]
        ends = _greedy_cuts(lengths[idx], batch_tokens)
        starts = np.concatenate([[0], ends[:-1]])
        keys += _keys(refs, idx[starts], idx[ends - 1], ends - starts)
        ahead += [tuple(dict.fromkeys(windows[w] + later))] * len(ends)
        window += [tuple(windows[w])] * len(ends)
        cuts.append(ends + cuts[-1][-1])
        orders.append(idx)
    plan = BatchPlan(np.concatenate([np.zeros(0, np.int64)] + orders), np.concatenate(cuts), keys, ahead, window)
    if lanes > 1 and not split:
        plan = _every_nth(plan, lane, lanes)
    global _readahead
    _readahead = dict(zip(plan.keys, plan.ahead))
    return plan


def plan_rank(refs: SequenceTable, batch_tokens: int, seed: int, epoch: int, rank: int, world: int,
              grad_accum: int) -> list[BatchPlan]:
    """Rank ``rank`` of ``world``'s plans of one epoch, one per micro-batch of a step: micro-batch ``m`` of every
    step comes from lane ``rank * grad_accum + m`` of ``world * grad_accum`` (``plan_batches``), so that a step
    trains on the same batches whatever the split of ``world * grad_accum`` into processes and micro-batches.

    Each batch reads ahead the current and next windows of all the rank's lanes at its step, so that the
    micro-batches of one step name the same files and each file is asked for once per visit.
    """
    plans = [plan_batches(refs, batch_tokens, seed, epoch, rank * grad_accum + m, world * grad_accum)
             for m in range(grad_accum)]
    global _readahead
    _readahead = {}
    for step in range(max(len(p) for p in plans)):
        names = tuple(dict.fromkeys(s for p in plans if len(p) for s in p.ahead[step % len(p)]))
        _readahead.update((p.keys[step], names) for p in plans if step < len(p))
    return plans


def _by_shard(refs: SequenceTable) -> dict[str, np.ndarray]:
    """Each shard file's sequences, as ascending indices into ``refs``."""
    order = np.argsort(refs.shard, kind="stable")
    counts = np.bincount(refs.shard, minlength=len(refs.names))
    starts = np.concatenate([[0], np.cumsum(counts)])
    return {name: order[starts[i] : starts[i + 1]] for i, name in enumerate(refs.names) if counts[i]}


def _greedy_cuts(lengths: np.ndarray, budget: int) -> np.ndarray:
    """``[B]`` int64 end offsets of the groups ``mtp_train.io.group_by_tokens`` cuts ``lengths [n]`` into: each
    group the longest run of at most ``budget`` tokens, or a single longer item."""
    total = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    # where a group starting at each item would end (one search for all), then the chain of groups from item 0
    nxt = np.maximum(np.searchsorted(total, total[:-1] + budget, side="right") - 1,
                     np.arange(1, len(lengths) + 1)).tolist()
    ends, i = [], 0
    while i < len(nxt):
        i = nxt[i]
        ends.append(i)
    return np.asarray(ends, np.int64)


def _every_nth(plan: BatchPlan, lane: int, lanes: int) -> BatchPlan:
    """Batches ``lane``, ``lane + lanes``, ... of ``plan``."""
    keep = range(lane, len(plan), lanes)
    parts = [plan.order[plan.bounds[b] : plan.bounds[b + 1]] for b in keep]
    sizes = np.asarray([len(p) for p in parts], np.int64)
    return BatchPlan(np.concatenate([np.zeros(0, np.int64)] + parts), np.concatenate([[0], np.cumsum(sizes)]),
                     [plan.keys[b] for b in keep], [plan.ahead[b] for b in keep], [plan.window[b] for b in keep])


def _keys(refs: SequenceTable, first: np.ndarray, last: np.ndarray, n: np.ndarray) -> list[tuple]:
    """What names each batch in ``_readahead``: its first and last sequences (shard file, first token) and its
    size, for batches given as ``first``, ``last`` (indices into ``refs``) and ``n``, each ``[B]``."""
    names = refs.names
    return [(names[a], b, names[c], d, e) for a, b, c, d, e in
            zip(refs.shard[first].tolist(), refs.start[first].tolist(), refs.shard[last].tolist(),
                refs.start[last].tolist(), n.tolist())]


# The latest plan's batches (``_keys``): the shard files of the batch's window and of the window this rank visits next.
_readahead: dict[tuple[str, int, str, int, int], tuple[str, ...]] = {}


def read_ahead(reader: Features, refs: list[SequenceRef] | SequenceTable) -> None:
    """If ``refs`` is a batch of the latest ``plan_batches``, hand its window's and the next window's shard files
    to ``reader.read_ahead`` (read whole in the background; a no-op for files already asked for), as many of them,
    in that order, as fit ``READ_AHEAD_BYTES`` together (``reader.shard_bytes``). Other batches (validation's) ask
    for nothing."""
    ahead = (_readahead.get((refs[0].shard, refs[0].start, refs[-1].shard, refs[-1].start, len(refs)))
             if len(refs) else None)
    if ahead is None:
        return
    sizes, total, fits = reader.shard_bytes, 0, 0
    for name in ahead:
        total += sizes[name]
        if total > READ_AHEAD_BYTES:
            break
        fits += 1
    reader.read_ahead(ahead[:fits])


def load_batch(reader: Features, refs: list[SequenceRef] | SequenceTable, batch_tokens: int, dtype: torch.dtype,
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
    names = [name for name in stored_names(reader.manifest) if name != "logsumexp"]
    layout = {name: reader.row_layout(name) for name in names}
    raw = {name: _staging(name, n * stored.itemsize * math.prod(row)) for name, (stored, row) in layout.items()}
    read_ahead(reader, refs)
    reader.read_rows(refs, lengths, raw)

    def convert(name: str, to: torch.dtype, layers: int | list[int] | None = None) -> torch.Tensor:
        stored, row = layout[name]
        src = raw[name].view(_NUMPY[stored]).reshape(n, *row)
        src = src if layers is None else src[:, layers]
        if stored == FP8:  # e4m3 bits times their rows' scales (float32), then the training dtype
            scale = raw["hidden_scale"].view(np.float32).reshape(n, -1)
            scale = scale if layers is None else scale[:, layers]
            if to != torch.float32:
                return _convert(torch.float32, dequantize_fp8_numpy(src, scale), to)
            out = torch.empty(src.shape, dtype=torch.float32)
            dequantize_fp8_numpy(src, scale, out=out.numpy())
            return out
        return _convert(stored, src, to)

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
    if "hidden_scale" in parts[0]:  # FP8: each row read back through its scale
        for p in parts:
            p["hidden"] = dequantize_fp8(p["hidden"], p["hidden_scale"])
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
          torch.int64: np.int64, torch.uint8: np.uint8, FP8: np.uint8}
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
