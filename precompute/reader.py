"""Read features back: memory-mapped shards, one sequence at a time, refused if from another target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    """Index of every stored sequence of a features directory.

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
        self._files: dict[str, object] = {}
        for entry in self.manifest.shards:
            with safe_open(self.root / entry.file, framework="pt") as f:
                cu = f.get_tensor("cu_seqlens").tolist()
            for row_id, a, b in zip(entry.row_ids, cu[:-1], cu[1:]):
                self.sequences.append(SequenceRef(row_id, entry.file, a, b))
        heldout = set(self.manifest.heldout_row_ids)
        self.train = [s for s in self.sequences if s.row_id not in heldout]
        self.heldout = [s for s in self.sequences if s.row_id in heldout]

    def _open(self, shard: str):
        if shard not in self._files:
            self._files[shard] = safe_open(self.root / shard, framework="pt")  # memory-mapped
        return self._files[shard]

    def load(self, ref: SequenceRef) -> dict[str, torch.Tensor]:
        f = self._open(ref.shard)
        names = ["input_ids", "loss_mask", "hidden", "logsumexp"]
        if self.manifest.topk:
            names += ["topk_logprobs", "topk_ids"]
        return {name: f.get_slice(name)[ref.start : ref.stop] for name in names}
