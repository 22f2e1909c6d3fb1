"""``mtp-train verify FEATURES_DIR``: check every shard against the manifest, and the rows' coverage (of an online
plan, which stores no shard, the coverage only).

Each precompute worker checks the shards it wrote (their sha256 read back from disk) before it marks itself
complete, so that a cluster's workers share the hashing; the merge after them checks headers and coverage only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

import numpy as np

from mtp_train.errors import UserError
from mtp_train.features.index import by_rank, load_indexes
from mtp_train.features.manifest import MERGED, Manifest, load_manifest, rank_manifest_name, union


def load_features_manifest(root: Path) -> Manifest:
    """``manifest.json``, or a union of the rank manifests when the merge has not happened."""
    if not root.is_dir():
        raise UserError(f"{root}: features directory not found")
    if (root / MERGED).is_file():
        return load_manifest(root / MERGED)
    parts = sorted(root.glob("manifest.rank-*.json"))
    if not parts:
        raise UserError(f"{root}: no manifest.json or manifest.rank-*.json; run precompute first")
    return union([(path, load_manifest(path)) for path in parts])


def _expected(manifest: Manifest, t: int, s: int) -> dict[str, tuple[tuple[int, ...], str]]:
    shapes = {
        "input_ids": ((t,), "I32"),
        "loss_mask": ((t,), "U8"),
        "cu_seqlens": ((s + 1,), "I64"),
        "hidden": ((t, len(manifest.layers), manifest.hidden_size), "BF16"),
        "logsumexp": ((t,), "F32"),
    }
    if manifest.hidden_dtype == "float8_e4m3fn":
        shapes["hidden"] = (shapes["hidden"][0], "F8_E4M3")
        shapes["hidden_scale"] = ((t, len(manifest.layers)), "F32")
    if manifest.topk:
        shapes["topk_logprobs"] = ((t, manifest.topk), "BF16")
        shapes["topk_ids"] = ((t, manifest.topk), "I32")
        shapes["tail_logprob"] = ((t,), "F32")
    return shapes


def check_shard(root: Path, manifest: Manifest, entry, rows: list[int], seq_tokens: np.ndarray,
                contents: bool = True) -> str | None:
    """The first problem with one shard, or None: its size, its header against the manifest, and its row ids and
    ``cu_seqlens`` against the index's ``rows`` and ``seq_tokens [num_seqs]``; ``contents``: its sha256 too."""
    path = root / entry.file
    if not path.is_file():
        return f"{path}: missing"
    if path.stat().st_size != entry.bytes:
        return f"{path}: {path.stat().st_size} bytes, manifest says {entry.bytes} (truncated or replaced)"
    if contents and _sha256(path) != entry.sha256:
        return f"{path}: sha256 mismatch (corrupted)"
    try:
        with safe_open(path, framework="pt") as f:
            if json.loads((f.metadata() or {}).get("row_ids", "null")) != rows:
                return f"{path}: header row ids differ from the index's"
            for name, (shape, dtype) in _expected(manifest, entry.num_tokens, entry.num_seqs).items():
                if name not in f.keys():
                    return f"{path}: tensor {name!r} missing"
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != shape or sl.get_dtype() != dtype:
                    return f"{path}: tensor {name!r} is {sl.get_dtype()} {sl.get_shape()}, expected {dtype} {list(shape)}"
            cu = f.get_tensor("cu_seqlens").numpy()
            if int(cu[0]) != 0 or not np.array_equal(np.diff(cu), seq_tokens):
                return f"{path}: cu_seqlens differ from the sequence lengths of the index"
    except (SafetensorError, OSError, ValueError) as e:  # a damaged header (ValueError: its row ids not JSON)
        return f"{path}: unreadable safetensors ({e})"
    return None


def check_shards(root: Path, manifest: Manifest, contents: bool = True) -> list[str]:
    """The problems of the shards ``manifest`` lists (:func:`check_shard` of each, against its rank's index)."""
    indexes, problems = load_indexes(root, manifest), []
    for rank, entries in by_rank(manifest).items():
        index = indexes[rank]
        for s, entry in enumerate(entries):
            problem = check_shard(root, manifest, entry, index.rows_of(s), index.shard_tokens[s], contents)
            problems += [problem] if problem else []
    return problems


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(root: Path, contents: bool = True) -> tuple[list[str], Manifest]:
    """All problems found (empty when the features are sound) and the manifest that was checked; ``contents``:
    every shard's sha256 too, else sizes, headers and the rows' coverage only."""
    manifest = load_features_manifest(root)
    problems = []
    if not manifest.complete:
        problems.append(f"{root}: precompute is not complete (rerun it to resume)")
    ranks = sorted(manifest.ranks)
    if ranks != list(range(manifest.world_size)):
        missing = sorted(set(range(manifest.world_size)) - set(ranks))
        problems.append(f"{root}: manifest(s) of rank(s) {missing} missing, e.g. {rank_manifest_name(missing[0])}")
    if not manifest.online:  # an online plan has no files to check, only its rows' coverage
        problems += check_shards(root, manifest, contents)
    indexes = load_indexes(root, manifest).values()
    covered = np.sort(np.concatenate([np.zeros(0, np.int64)] + [r for i in indexes for r in i.shard_rows]))
    if (covered[1:] == covered[:-1]).any():
        problems.append(f"{root}: some rows are stored more than once")
    owned = np.sort(np.concatenate([np.zeros(0, np.int64)] + [i.owned for i in indexes]))
    if manifest.complete and not np.array_equal(covered, owned):
        lost = np.setdiff1d(owned, covered)
        problems.append(f"{root}: {len(lost)} row(s) not covered by any shard, e.g. row {lost[:1].tolist()}")
    return problems, manifest
