"""Stage 1: dataset -> chat-templated tokens with loss masks -> runtime features in shards, resumably.

Each worker (rank r of W) owns a contiguous block of the rows. Its rows are cut, in order, into
shards of about ``precompute.shard_tokens`` tokens; each shard is one ``Engine.score()`` call and
one safetensors file, and each token-budget batch of that call advances the progress. A rerun
recomputes the same plan, checks that the shards already recorded in its manifest match it, and
continues with the first missing shard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.io import crash_point, group_by_tokens
from mtp_train.models.config import ModelConfig
from mtp_train.progress import Progress
from mtp_train.recipe import Recipe
from mtp_train.threads import set_threads, warn_if_oversubscribed
from mtp_train.data.dataset import Row, encode_many, heldout_ids, load_rows, rank_slice
from mtp_train.features.layers import eagle3_layers, stored_layers
from mtp_train.features.manifest import (
    MERGED,
    Manifest,
    ShardEntry,
    data_fingerprint,
    load_manifest,
    rank_manifest_name,
    save_manifest,
    shard_name,
    target_fingerprint,
    text_fingerprint,
    tokenizer_fingerprint,
    union,
)
from mtp_train.precompute.preflight import check_data_files, check_rows, mask_counts
from mtp_train.data.tokenizer import load_tokenizer
from mtp_train.features.writer import ShardWriter


@dataclass(frozen=True)
class Worker:
    rank: int
    world: int


def resolve_worker(rank: int | None, world: int | None, tp: int) -> Worker:
    """Flags win; then a SLURM array; then torchrun's RANK/WORLD_SIZE (only without TP, whose ranks share rows)."""
    env = os.environ
    if rank is not None or world is not None:
        w = Worker(rank or 0, world or 1)
    elif "SLURM_ARRAY_TASK_COUNT" in env:
        first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        w = Worker(int(env["SLURM_ARRAY_TASK_ID"]) - first, int(env["SLURM_ARRAY_TASK_COUNT"]))
    elif tp == 1 and "WORLD_SIZE" in env:
        w = Worker(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]))
    else:
        w = Worker(0, 1)
    if not 0 <= w.rank < w.world:
        raise UserError(f"--rank {w.rank} is outside --world-size {w.world}")
    return w


def recipe_settings(recipe: Recipe, world: int, cfg: ModelConfig) -> dict:
    """Everything that changes the features' content or layout; a rerun must match it exactly."""
    d, p = recipe.data, recipe.precompute
    extra = eagle3_layers(recipe, cfg)
    return {
        "format": d.format, "max_length": d.max_length, "max_rows": d.max_rows, "skip_bad_rows": d.skip_bad_rows,
        "heldout_rows": d.heldout_rows, "regenerate": d.regenerate,
        "sampling": d.sampling.model_dump() if d.regenerate else None,
        "seed": recipe.seed, "layers": p.layers, "topk": p.topk, "shard_tokens": p.shard_tokens, "world_size": world,
        **({"eagle3_layers": extra} if extra else {}),
    }


def _mismatch(old: Manifest, fingerprint: dict[str, str], settings: dict) -> str | None:
    for key, value in fingerprint.items():
        if old.fingerprint.get(key) != value:
            if key == "settings":
                fields = sorted(k for k in settings if old.settings.get(k) != settings.get(k))
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
    if old is None and path.is_file():
        path.unlink()
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


def _shard_tensors(scored, rows: list[tuple[list[int], list[int]]], topk: int) -> dict[str, torch.Tensor]:
    tensors = {
        "input_ids": torch.tensor([t for ids, _ in rows for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for _, mask in rows for m in mask], dtype=torch.uint8),
        "cu_seqlens": scored.cu_seqlens.to(torch.int64),
        "hidden": scored.hidden.to(torch.bfloat16).cpu().contiguous(),
        "logsumexp": scored.logsumexp.float().cpu().contiguous(),
    }
    if topk:
        tensors["topk_logprobs"] = scored.topk_logprobs.to(torch.bfloat16).cpu().contiguous()
        tensors["topk_ids"] = scored.topk_ids.to(torch.int32).cpu().contiguous()
        tensors["tail_logprob"] = scored.tail_logprob.float().cpu().contiguous()
    return tensors


def run_precompute(
    recipe: Recipe, rank: int | None = None, world: int | None = None, overwrite: bool = False
) -> Manifest:
    from mtp_train.runtime.device import default_device, resolve_dtype
    from mtp_train.runtime.engine import Engine
    from mtp_train.models.tp import init_tensor_parallel

    start = time.perf_counter()
    set_threads(recipe.threads)
    worker = resolve_worker(rank, world, recipe.target.tp)
    out, target = recipe.features_dir, recipe.target.path
    tokenizer = load_tokenizer(recipe)
    cfg = ModelConfig.from_hf(find_checkpoint(target).config, str(target / "config.json"))
    settings = recipe_settings(recipe, worker.world, cfg)
    check_data_files(recipe)
    fingerprint = {
        "target": target_fingerprint(target),
        "tokenizer": tokenizer_fingerprint(target),
        "chat_template": text_fingerprint(str(tokenizer.chat_template)),
        "data": data_fingerprint(recipe.data.train),
        "settings": text_fingerprint(json.dumps(settings, sort_keys=True)),
    }
    if not overwrite and (out / MERGED).is_file():
        merged = load_manifest(out / MERGED)
        if merged.complete and merged.fingerprint == fingerprint:
            print(f"precompute: {out / MERGED} is complete and matches the recipe; skipped", file=sys.stderr)
            return merged
    device = default_device()
    tp = init_tensor_parallel(recipe.target.tp, device)
    # Under TP every rank runs the same forwards, but only the leader touches the directory.
    old = prepare_directory(out, worker.rank, fingerprint, settings, overwrite) if tp.is_leader else None
    if tp.size > 1:
        torch.distributed.barrier()
        manifest_file = out / rank_manifest_name(worker.rank)
        if not tp.is_leader and manifest_file.is_file():
            old = load_manifest(manifest_file)
    data = load_rows(recipe.data.train, recipe.data.format, recipe.data.skip_bad_rows, recipe.data.max_rows)
    check_rows(data, tokenizer, str(target))
    all_ids = [r.row_id for r in data.rows]
    mine = rank_slice(all_ids, worker.rank, worker.world)

    engine = Engine.for_target(recipe.target, resolve_dtype(recipe.target.dtype, device), device, tp,
                               max_batch_tokens=recipe.precompute.batch_tokens)
    by_id = {r.row_id: r for r in data.rows}
    rows: list[Row] = [by_id[i] for i in mine]
    if recipe.data.regenerate:
        from mtp_train.precompute.regenerate import regenerate, regenerated_path

        source = {k: fingerprint[k] for k in ("target", "tokenizer", "chat_template", "data")}
        regen_key = text_fingerprint(json.dumps({**source, "sampling": recipe.data.sampling.model_dump(),
                                                 "max_length": recipe.data.max_length}, sort_keys=True))
        warn_if_oversubscribed("precompute", tp.is_leader)  # before the long regeneration
        rows = regenerate(rows, tokenizer, engine, recipe.data.sampling, regenerated_path(out, worker.rank),
                          regen_key, recipe.data.max_length, write=tp.is_leader)
    encoded = encode_many(tokenizer, [r.content for r in rows], recipe.data.max_length, [r.row_id for r in rows])
    by_file = mask_counts(data, rows, encoded)
    masked, total = (sum(c[i] for c in by_file.values()) for i in (0, 1))

    manifest = old or Manifest(
        ranks=[worker.rank], world_size=worker.world, fingerprint=fingerprint, settings=settings,
        layers=stored_layers(recipe, cfg), hidden_size=engine.cfg.hidden_size,
        topk=recipe.precompute.topk, regenerated=recipe.data.regenerate,
        sampling=recipe.data.sampling.model_dump() if recipe.data.regenerate else None,
        row_ids=mine, heldout_row_ids=sorted(heldout_ids_from(all_ids, recipe)),
        skipped_rows=[{"file": f, "index": i, "why": w} for f, i, w in data.bad_rows],
        truncated_rows=sum(t for _, _, t in encoded),
    )
    plan = group_by_tokens([len(ids) for ids, _, _ in encoded], recipe.precompute.shard_tokens)
    done = len(manifest.shards)
    for s, entry in enumerate(manifest.shards):
        if s >= len(plan) or entry.row_ids != [rows[i].row_id for i in plan[s]]:
            raise UserError(f"{out / entry.file}: holds rows that no longer match the plan; rerun with --overwrite")
    if tp.is_leader and done < len(plan) and (out / MERGED).is_file():
        (out / MERGED).unlink()  # stale until every rank is complete again
    manifest_path = out / rank_manifest_name(worker.rank)

    def record(index: int, path: Path, sha: str, size: int) -> None:
        ids = [rows[i].row_id for i in plan[index]]
        tokens = sum(len(encoded[i][0]) for i in plan[index])
        manifest.shards.append(ShardEntry(file=path.name, num_seqs=len(ids), num_tokens=tokens, row_ids=ids,
                                          sha256=sha, bytes=size))
        save_manifest(manifest_path, manifest)

    print(f"precompute: rank {worker.rank}/{worker.world}, {len(rows)} rows, {total:,} tokens "
          f"({masked / total:.1%} masked in, {manifest.truncated_rows} truncated to {recipe.data.max_length}), "
          f"{len(plan)} shards, {done} already done", file=sys.stderr)
    for path, (file_masked, file_total) in by_file.items():
        print(f"precompute: {path}: {file_masked / file_total:.1%} of its tokens masked in", file=sys.stderr)
    if not recipe.data.regenerate:
        warn_if_oversubscribed("precompute", tp.is_leader)
    writer = ShardWriter(record) if tp.is_leader else None
    stored = sum(len(encoded[i][0]) for shard in plan[:done] for i in shard)  # tokens of the shards already written
    progress = Progress("precompute", total, "tokens", initial=stored, enabled=tp.is_leader)
    try:
        for index in range(done, len(plan)):
            crash_point("forward", index)
            seqs = [(encoded[i][0], encoded[i][1]) for i in plan[index]]
            progress.note = f"shard {index + 1}/{len(plan)}"
            scored = engine.score([ids for ids, _ in seqs], layers=manifest.layers,
                                  topk=recipe.precompute.topk, on_batch=lambda n: progress.update(n, tokens=n))
            if writer is not None:
                meta = {"format_version": "1", "rank": str(worker.rank),
                        "row_ids": json.dumps([rows[i].row_id for i in plan[index]])}
                writer.submit(index, out / shard_name(worker.rank, index), _shard_tensors(scored, seqs, manifest.topk),
                              meta)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    if not tp.is_leader:
        return manifest
    manifest.complete = True
    save_manifest(manifest_path, manifest)
    merged = merge_manifests(out, worker.world)
    totals = manifest.totals()
    print(f"precompute: rank {worker.rank} wrote {totals['tokens']:,} tokens in {len(manifest.shards)} shards, "
          f"{totals['bytes_per_token']} bytes/token, {time.perf_counter() - start:.0f}s"
          + (f"; {out / MERGED} covers all {worker.world} rank(s)" if merged else "; waiting for other ranks"))
    return manifest


def heldout_ids_from(all_ids: list[int], recipe: Recipe) -> set[int]:
    picks = heldout_ids(len(all_ids), recipe.data.heldout_rows, recipe.seed)
    return {all_ids[i] for i in picks}
