"""Read features back: one sequence at a time (memory-mapped) or a whole batch's rows at once (positioned reads),
refused if from another target.

At start-up a reader reads ``manifest.json`` and the ranks' indexes (where every sequence lives), and opens each
shard once, for its header; it never reads a shard's ``cu_seqlens`` or keeps a Python object per sequence."""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import os
import struct
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from mtp_train.errors import UserError
from mtp_train.features.index import SequenceRef, SequenceTable, by_rank, load_indexes, sequence_table
from mtp_train.features.manifest import Manifest, ShardEntry, target_fingerprint
from mtp_train.features.verify import load_features_manifest
from mtp_train.threads import leave_signals_to_main_thread


__all__ = ["FeatureReader", "SequenceRef", "SequenceTable"]


class FeatureReader:
    """Index of every stored sequence of a features directory, read through memory-mapped shards.

    ``load(ref)`` returns that sequence's tensors: ``input_ids [n]`` int32, ``loss_mask [n]`` uint8,
    ``hidden [n, L, H]`` bf16 (or e4m3, with ``hidden_scale [n, L]`` float32), ``logsumexp [n]`` float32 and, when
    K > 0, ``topk_logprobs [n, K]`` bf16, ``topk_ids [n, K]`` int32 and ``tail_logprob [n]`` float32.
    ``read_rows`` reads many sequences' rows of several tensors, each packed into one buffer (the trainer's
    batches); it is safe to call from several threads at once.
    """

    def __init__(self, root: Path, target: Path | None = None) -> None:
        self.root = Path(root)
        self.manifest: Manifest = load_features_manifest(self.root)
        if not self.manifest.complete:
            raise UserError(f"{self.root}: features are incomplete; rerun precompute to finish them")
        if self.manifest.online:
            raise UserError(f"{self.root}: these features are planned for online training (precompute.mode online) "
                            "and hold no shards; train with precompute.mode online, or rerun precompute with "
                            "precompute.mode offline --overwrite")
        if target is not None and target_fingerprint(Path(target)) != self.manifest.fingerprint["target"]:
            raise UserError(f"{self.root}: features were computed from a different target than {target}")
        self._files: dict[str, MappedShard] = {}
        self._fds: dict[str, ShardFile] = {}
        self._lock = threading.Lock()
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None  # the first opened shard's
        self._ahead: set[str] = set()  # the shards the last read_ahead asked for
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}  # shard -> its read ahead
        self.shard_bytes: dict[str, int] = {e.file: e.bytes for e in self.manifest.shards}  # (read ahead: page cache)
        groups = by_rank(self.manifest)
        indexes = load_indexes(self.root, self.manifest)
        entries = [e for shards in groups.values() for e in shards]
        for entry in entries:
            _check_shard(self.root / entry.file, entry)
        self.sequences: SequenceTable = sequence_table([e.file for e in entries], list(indexes.values()))
        heldout = np.isin(self.sequences.row_id, np.asarray(self.manifest.heldout_row_ids, np.int64))
        self.train: SequenceTable = self.sequences[np.flatnonzero(~heldout)]
        self.heldout: SequenceTable = self.sequences[np.flatnonzero(heldout)]

    def _open(self, shard: str) -> MappedShard:
        if shard not in self._files:
            self._files[shard] = MappedShard(self.root / shard)
        return self._files[shard]

    def load(self, ref: SequenceRef) -> dict[str, torch.Tensor]:
        """Views into the memory-mapped shard (no copy until the caller packs them)."""
        f = self._open(ref.shard)
        return {name: f.rows(name, ref.start, ref.stop) for name in stored_names(self.manifest)}

    def _file(self, shard: str) -> ShardFile:
        f = self._fds.get(shard)
        if f is None:
            with self._lock:  # the trainer's prefetch thread and validation may open shards at once
                f = self._fds.get(shard)
                if f is None:
                    f = ShardFile(self.root / shard)
                    layout = {k: (dtype, tuple(shape[1:])) for k, (dtype, shape, _) in f.meta.items()}
                    if self._layout is None:
                        self._layout = layout
                    for k, v in self._layout.items():  # cu_seqlens has one row per sequence, not per token
                        if k != "cu_seqlens" and layout.get(k) != v:
                            raise UserError(f"{f.path}: {k} is {layout.get(k)}, other shards have {v}")
                    self._fds[shard] = f
        return f

    def row_layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Stored dtype and per-token row shape of tensor ``name`` (the same in every shard)."""
        if self._layout is None:
            self._file(self.manifest.shards[0].file)
        return self._layout[name]

    def read_ahead(self, shards: tuple[str, ...] | list[str]) -> None:
        """Read these shard files whole, in this order, into the page cache on a helper thread (8 MiB sequential
        reads into one scratch buffer: the disk's full sequential rate, which ``POSIX_FADV_WILLNEED`` over a whole
        file did not reach here). ``read_rows`` waits for a shard's read in progress rather than adding random reads
        of its rows. Shards that the previous call named were already asked for and are skipped, so a loader can
        name its current and next window on every batch and each file is read once per visit.
        """
        shards = tuple(shards)
        with self._lock:
            new = [s for s in shards if s not in self._ahead]
            self._ahead = set(shards)
            if new and self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-readahead",
                                                      initializer=leave_signals_to_main_thread)
        for shard in new:
            f = self._file(shard)
            self._pending[shard] = self._ahead_pool.submit(_read_whole, f)

    def reset_read_ahead(self) -> None:
        """Finish or cancel the reads ahead and forget which shards were asked for, so that the next ``read_ahead``
        reads all it names again."""
        with self._lock:
            self._ahead = set()
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.cancel()
        wait(pending.values())

    def read_rows(self, refs: list[SequenceRef], lengths: list[int], out: dict[str, np.ndarray]) -> None:
        """For each tensor ``name`` in ``out``: rows ``[ref.start, ref.start + n)`` of every ref, n its length,
        packed back to back into ``out[name]`` (a buffer of exactly ``sum(lengths)`` rows' bytes), with one
        positioned read per sequence and tensor.

        Ranges are read in file order. What the page cache holds is read first without waiting (``RWF_NOWAIT``);
        every range that missed is then announced to the kernel at once (``POSIX_FADV_WILLNEED``), so that its
        disk reads are queued together rather than one after the other, and read.
        """
        views, row_bytes = {}, {}
        for name, buf in out.items():
            dtype, row = self.row_layout(name)
            row_bytes[name] = dtype.itemsize * math.prod(row)
            views[name] = memoryview(buf).cast("B")
            if views[name].nbytes != row_bytes[name] * sum(lengths):
                raise ValueError(f"read_rows: {name} buffer holds {views[name].nbytes} bytes, "
                                 f"the rows need {row_bytes[name] * sum(lengths)}")
        if self._pending:  # let a whole-file read in progress bring these rows in, rather than racing it
            wait([f for s in {r.shard for r in refs} if (f := self._pending.get(s)) is not None])
        jobs, pos = [], 0
        for ref, n in zip(refs, lengths):
            if not 0 <= n <= ref.stop - ref.start:
                raise ValueError(f"read_rows: {n} rows asked of a {ref.stop - ref.start}-row sequence")
            f = self._file(ref.shard)
            for name, rb in row_bytes.items():
                if n:
                    jobs.append((f.fd, f.meta[name][2] + ref.start * rb, n * rb, f, views[name], pos * rb))
            pos += n
        jobs.sort(key=lambda j: j[:2])
        missed = jobs
        if _NOWAIT is not None:  # first take what the page cache holds, without waiting for the disk
            missed = []
            for fd, offset, size, f, view, at in jobs:
                got = _read_cached(fd, view[at : at + size], offset)
                if got < size:
                    missed.append((fd, offset + got, size - got, f, view, at + got))
        if _WILLNEED is not None:  # queue every missing range at once, so the disk sees them together
            for fd, offset, size, *_ in missed:
                os.posix_fadvise(fd, offset, size, _WILLNEED)
        for fd, offset, size, f, view, at in missed:
            f.read_into(view[at : at + size], offset)


_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def stored_names(manifest: Manifest) -> list[str]:
    """The per-token tensors a shard of ``manifest`` holds (not ``cu_seqlens``)."""
    names = ["input_ids", "loss_mask", "hidden"] + (["hidden_scale"] if manifest.hidden_dtype != "bfloat16" else [])
    return names + ["logsumexp"] + (["topk_logprobs", "topk_ids", "tail_logprob"] if manifest.topk else [])


def _read_cached(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` what the page cache holds, without waiting for the disk; the bytes read
    (0 on EAGAIN, or on a file system without ``RWF_NOWAIT``: the blocking read after it decides)."""
    try:
        return os.preadv(fd, [view], offset, _NOWAIT)
    except OSError:
        return 0


def _read_whole(f: ShardFile) -> None:
    """Read the part of a file that is not in the page cache yet, start to end, into this thread's scratch buffer
    (only to bring it into the page cache; a file already cached costs one ``mincore``, no copy)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(8 << 20))
    try:
        span = _uncached(f.fd, os.fstat(f.fd).st_size)
        if span is None:
            return
        offset, end = span
        while offset < end and (n := os.preadv(f.fd, [buf[: end - offset]], offset)):
            offset += n
    except OSError:  # only a hint: the row reads still read what they need
        pass


def _uncached(fd: int, size: int) -> tuple[int, int] | None:
    """Byte range from the first to the last page of the file that is not in the page cache (``mincore`` on a
    temporary mapping), None if every page is; the whole file where that cannot be asked."""
    if size == 0:
        return None
    try:
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = np.zeros(pages, np.uint8)
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            arr = np.frombuffer(mm, np.uint8)
            rc = _libc().mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size),
                                 ctypes.c_void_p(vec.ctypes.data))
            del arr
        if rc != 0:
            return 0, size
    except (OSError, AttributeError, ValueError):
        return 0, size
    missing = np.flatnonzero((vec & 1) == 0)
    if not len(missing):
        return None
    return int(missing[0]) * page, min(size, (int(missing[-1]) + 1) * page)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_scratch = threading.local()
_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "I32": torch.int32,
           "I64": torch.int64, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}


def damaged(path: Path, problem: str) -> UserError:
    """A shard that does not read as its manifest says: one line naming it and the command that checks them all."""
    return UserError(f"{path}: {problem}; check the features with `mtp-train verify {path.parent}` "
                     "(`mtp-train precompute RECIPE --overwrite` writes them again)")


def _check_shard(path: Path, entry: ShardEntry) -> None:
    """The shard is there with the manifest's size, and its header (one open, one read) reads and holds the
    manifest's tokens and sequences (no hashing: ``mtp-train verify`` checks the contents)."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise damaged(path, "missing") from None
    if actual != entry.bytes:
        raise damaged(path, f"{actual} bytes, the manifest says {entry.bytes} (truncated or replaced)")
    meta, _ = _read_header(path)
    shapes = {name: meta[name][1] if name in meta else None for name in ("input_ids", "cu_seqlens")}
    if shapes != {"input_ids": [entry.num_tokens], "cu_seqlens": [entry.num_seqs + 1]}:
        raise damaged(path, f"its header's shapes {shapes} are not the manifest's {entry.num_tokens} tokens in "
                            f"{entry.num_seqs} sequences (replaced)")


def _read_header(path: Path) -> tuple[dict[str, tuple[torch.dtype, list[int], int]], int]:
    """Each tensor's (dtype, shape, byte offset in the data section), and where the data section starts; a file
    that is missing, shorter than its header says or whose header does not parse is a :func:`damaged` shard."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
        header.pop("__metadata__", None)
        meta = {k: (_DTYPES[v["dtype"]], v["shape"], v["data_offsets"][0]) for k, v in header.items()}
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
    except FileNotFoundError:
        raise damaged(Path(path), "missing") from None
    except OSError as e:
        raise damaged(Path(path), f"cannot be read ({e.strerror or e})") from None
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError):  # ValueError: bad JSON/UTF-8
        raise damaged(Path(path), "its safetensors header does not parse") from None
    if 8 + n + end > size:
        raise damaged(Path(path), f"file ends at byte {size}, before the data its header lists (truncated)")
    return meta, 8 + n


class ShardFile:
    """An open safetensors file read with ``os.preadv`` (no file position, so threads and forks share it).

    ``meta[name]`` is (dtype, shape, absolute byte offset of the tensor's data). The descriptor closes when the
    object is collected.
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        meta, data = _read_header(path)
        self.meta = {k: (dtype, shape, data + offset) for k, (dtype, shape, offset) in meta.items()}
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise damaged(Path(path), f"cannot be opened ({e.strerror or e})") from None
        weakref.finalize(self, os.close, self.fd)

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` with the file's bytes from ``offset``; a file that ends early or fails to read is a
        :func:`damaged` shard."""
        while len(buf):
            try:
                n = os.preadv(self.fd, [buf], offset)
            except OSError as e:
                raise damaged(Path(self.path), f"read failed at byte {offset} ({e.strerror or e})") from None
            if n == 0:
                raise damaged(Path(self.path),
                              f"file ends at byte {offset}, before the data its header lists (truncated)")
            buf, offset = buf[n:], offset + n


class MappedShard:
    """A safetensors file mapped into memory once; ``rows(name, a, b)`` is a zero-copy view of rows a..b.

    The header (8-byte little-endian length, then JSON with each tensor's dtype, shape and byte
    offsets) is the safetensors format's own; slicing the mapping directly avoids a per-call
    round trip through ``safe_open`` in ``FeatureReader.load``.
    """

    def __init__(self, path: Path) -> None:
        self._meta, data = _read_header(path)
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=data)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        dtype, shape, offset = self._meta[name]
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        raw = self._data[offset + start * row_bytes : offset + stop * row_bytes]
        with warnings.catch_warnings():  # the mapping is read-only; tensors built on it are only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw).view(dtype).view(stop - start, *shape[1:])
