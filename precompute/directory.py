"""The features directory: a rank's leftovers cleaned and its manifest checked before it resumes, and the ranks'
manifests merged into ``manifest.json`` once all of them are complete."""

from __future__ import annotations

from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.features.index import index_name
from mtp_train.features.manifest import MERGED, Manifest, load_manifest, rank_manifest_name, save_manifest, union


def _mismatch(old: Manifest, fingerprint: dict[str, str], settings: dict) -> str | None:
    for key, value in fingerprint.items():
        if old.fingerprint.get(key) != value:
            if key == "settings":
                fields = sorted(k for k in {*settings, *old.settings} if old.settings.get(k) != settings.get(k))
                return "recipe field(s) " + ", ".join(fields)
            return {"target": "target weights or config", "data": "dataset files"}.get(key, key)
    return None


def prepare_directory(out: Path, rank: int, fingerprint: dict[str, str], settings: dict, overwrite: bool
                      ) -> Manifest | None:
    """Clean this rank's leftovers and return its manifest to resume from, if any."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"shard-{rank:05d}-"
    for tmp in out.glob(f".{prefix}*.tmp"):
        tmp.unlink()
    path = out / rank_manifest_name(rank)
    try:
        old = load_manifest(path) if path.is_file() else None
    except UserError:  # another features format
        if not overwrite:
            raise
        old = None
    if old is not None:
        why = _mismatch(old, fingerprint, settings)
        if why and not overwrite:
            raise UserError(f"{path}: existing features were made with different {why}; rerun with --overwrite")
        if why:
            old = None
    keep = {s.file for s in old.shards} if old else set()
    for shard in out.glob(f"{prefix}*.safetensors"):
        if shard.name not in keep:  # written, but the manifest never recorded it
            shard.unlink()
    if old is None:
        path.unlink(missing_ok=True)
        (out / index_name(rank)).unlink(missing_ok=True)
    return old


def merge_manifests(out: Path, world: int) -> Manifest | None:
    """Write ``manifest.json`` as the union of every rank's manifest, once all of them are complete."""
    parts = []
    for r in range(world):
        path = out / rank_manifest_name(r)
        if not path.is_file():
            return None
        part = load_manifest(path)
        if not part.complete:
            return None
        parts.append((path, part))
    merged = union(parts)
    save_manifest(out / MERGED, merged)
    return merged
