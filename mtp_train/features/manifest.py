"""The features manifest and the fingerprints that tie features to their target, tokenizer and data.

Each worker keeps ``manifest.rank-RRRRR.json`` for its own shards; when every rank is complete,
``manifest.json`` holds their union. All manifests are written atomically. They hold a summary only (per shard: its
file, sequences, tokens, bytes and sha256): which rows each shard holds is in the ranks' binary indexes
(``mtp_train.features.index``), so that the manifest stays small at millions of sequences.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from mtp_train.errors import UserError
from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.io import write_json_atomic

# 2: shards hold ``tail_logprob`` (the exact mass outside the top-K); 3: row ids and sequence lengths in the ranks'
# binary indexes (``index.rank-RRRRR.safetensors``), not in the manifest
FORMAT_VERSION = 3
MERGED = "manifest.json"


def rank_manifest_name(rank: int) -> str:
    return f"manifest.rank-{rank:05d}.json"


def shard_name(rank: int, index: int) -> str:
    return f"shard-{rank:05d}-{index:05d}.safetensors"


class ShardEntry(BaseModel):
    file: str
    rank: int  # the worker that wrote it; its index holds the shard's row ids and sequence lengths
    num_seqs: int
    num_tokens: int
    sha256: str
    bytes: int


class Manifest(BaseModel):
    """What a features directory (or one rank's part of it) holds.

    ``hidden`` is ``[T, len(layers), hidden_size]`` in ``hidden_dtype`` (``bfloat16``, or ``float8_e4m3fn`` with
    ``hidden_scale [T, len(layers)]``: ``mtp_train.features.tensors``); the last layer is stored before the final
    norm (``last_layer_pre_norm``). ``topk`` is K of ``topk_logprobs``/``topk_ids``. ``online``: the shards are
    planned, not written (``precompute.mode: online``): training scores each one when it needs it.
    """

    format_version: int = FORMAT_VERSION
    ranks: list[int]
    world_size: int
    complete: bool = False
    fingerprint: dict[str, str]
    settings: dict[str, Any]
    layers: list[int]
    last_layer_pre_norm: bool = True
    hidden_size: int
    hidden_dtype: str = "bfloat16"
    topk: int
    online: bool = False
    regenerated: bool = False
    sampling: dict[str, Any] | None = None
    num_rows: int  # rows these ranks own (bad rows excluded); their ids are in the ranks' indexes
    heldout_row_ids: list[int]  # those of these ranks' rows that training never sees
    skipped_rows: list[dict[str, Any]] = []
    truncated_rows: int = 0
    shards: list[ShardEntry] = []

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def totals(self) -> dict[str, float]:
        tokens = self.total_tokens
        return {
            "sequences": sum(s.num_seqs for s in self.shards),
            "tokens": tokens,
            "bytes": self.total_bytes,
            "bytes_per_token": round(self.total_bytes / tokens, 1) if tokens else 0.0,
        }


def union(parts: list[tuple[Path, Manifest]]) -> Manifest:
    """One manifest covering every rank's part; complete only when every part is. Parts must share a fingerprint."""
    merged = parts[0][1].model_copy(deep=True)
    for path, part in parts[1:]:
        if part.fingerprint != merged.fingerprint:
            raise UserError(f"{path}: fingerprint differs from {parts[0][0].name}'s; these ranks ran different recipes")
        merged.ranks += part.ranks
        merged.num_rows += part.num_rows
        merged.heldout_row_ids = sorted(merged.heldout_row_ids + part.heldout_row_ids)
        merged.skipped_rows += part.skipped_rows
        merged.truncated_rows += part.truncated_rows
        merged.shards += part.shards
        merged.complete = merged.complete and part.complete
    return merged


def save_manifest(path: Path, manifest: Manifest) -> None:
    data = manifest.model_dump()
    data["totals"] = manifest.totals()
    write_json_atomic(path, data)


def load_manifest(path: Path) -> Manifest:
    """A manifest file; one that does not read as a manifest of this format is a one-line error naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, or not UTF-8
        raise UserError(f"{path}: not a features manifest ({str(e)[:160]}); "
                        "rerun precompute with --overwrite") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a features manifest (not a JSON object); rerun precompute with --overwrite")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise UserError(f"{path}: features format {version} is not this toolkit's format {FORMAT_VERSION}; "
                        "rerun precompute with --overwrite")
    data.pop("totals", None)
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise UserError(f"{path}: not a features manifest (field {where!r}: {first['msg']}); "
                        "rerun precompute with --overwrite") from None


def _sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def target_fingerprint(root: Path) -> str:
    """sha256 of config.json plus each weight file's name, size and safetensors header (not the tensors)."""
    ckpt = find_checkpoint(root)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for path in ckpt.weight_files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(path.name.encode() + str(path.stat().st_size).encode() + f.read(n))
    return h.hexdigest()


def tokenizer_fingerprint(root: Path) -> str:
    files = [root / n for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model") if (root / n).is_file()]
    return _sha256_files(files)


def data_fingerprint(files: list[Path]) -> str:
    paths: list[Path] = []
    for f in files:
        paths += sorted(p for p in f.rglob("*") if p.is_file()) if f.is_dir() else [f]
    return _sha256_files(paths)


def text_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
