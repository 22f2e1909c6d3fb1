"""Read features back: memory-mapped shards, one sequence at a time, refused if from another target."""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from mtp_train.errors import UserError
from precompute.manifest import Manifest, target_fingerprint
from precompute.verify import load_features_manifest


@dataclass(frozen=True)
class SequenceRef:
    """Where one stored sequence lives: shard file and token range ``[start, stop)``."""

    row_id: int
    shard: str
    start: int
    stop: int


class FeatureReader:
    """Index of every stored sequence of a features directory, read through memory-mapped shards.

    ``load(ref)`` returns that sequence's tensors: ``input_ids [n]`` int32, ``loss_mask [n]`` uint8,
    ``hidden [n, L, H]`` bf16, ``logsumexp [n]`` float32 and, when K > 0, ``topk_logprobs [n, K]``
    bf16 and ``topk_ids [n, K]`` int32.
    """

    def __init__(self, root: Path, target: Path | None = None) -> None:
        self.root = Path(root)
        self.manifest: Manifest = load_features_manifest(self.root)
        if not self.manifest.complete:
            raise UserError(f"{self.root}: features are incomplete; rerun precompute to finish them")
        if target is not None and target_fingerprint(Path(target)) != self.manifest.fingerprint["target"]:
            raise UserError(f"{self.root}: features were computed from a different target than {target}")
        self.sequences: list[SequenceRef] = []
        self._files: dict[str, MappedShard] = {}
        for entry in self.manifest.shards:
            with safe_open(self.root / entry.file, framework="pt") as f:
                cu = f.get_tensor("cu_seqlens").tolist()
            for row_id, a, b in zip(entry.row_ids, cu[:-1], cu[1:]):
                self.sequences.append(SequenceRef(row_id, entry.file, a, b))
        heldout = set(self.manifest.heldout_row_ids)
        self.train = [s for s in self.sequences if s.row_id not in heldout]
        self.heldout = [s for s in self.sequences if s.row_id in heldout]

    def _open(self, shard: str) -> MappedShard:
        if shard not in self._files:
            self._files[shard] = MappedShard(self.root / shard)
        return self._files[shard]

    def load(self, ref: SequenceRef) -> dict[str, torch.Tensor]:
        """Views into the memory-mapped shard (no copy until the caller packs them)."""
        f = self._open(ref.shard)
        names = ["input_ids", "loss_mask", "hidden", "logsumexp"]
        if self.manifest.topk:
            names += ["topk_logprobs", "topk_ids"]
        return {name: f.rows(name, ref.start, ref.stop) for name in names}


_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "I32": torch.int32,
           "I64": torch.int64, "U8": torch.uint8}


class MappedShard:
    """A safetensors file mapped into memory once; ``rows(name, a, b)`` is a zero-copy view of rows a..b.

    The header (8-byte little-endian length, then JSON with each tensor's dtype, shape and byte
    offsets) is the safetensors format's own; slicing the mapping directly avoids a per-call
    round trip through ``safe_open`` on the training hot path.
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        self._meta = {k: (_DTYPES[v["dtype"]], v["shape"], v["data_offsets"][0]) for k, v in header.items()}

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        dtype, shape, offset = self._meta[name]
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        raw = self._data[offset + start * row_bytes : offset + stop * row_bytes]
        with warnings.catch_warnings():  # the mapping is read-only; tensors built on it are only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw).view(dtype).view(stop - start, *shape[1:])
