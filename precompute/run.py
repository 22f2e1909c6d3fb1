"""Stage 1: dataset -> chat-templated tokens with loss masks -> runtime features in shards, resumably.

Each worker (rank r of W) owns a contiguous block of the rows. Its rows are cut, in order, into
shards of about ``precompute.shard_tokens`` tokens; each shard is one ``Engine.score()`` call and
one safetensors file, and each token-budget batch of that call advances the progress. A rerun
recomputes the same plan, checks that the shards already recorded in its manifest match it, and
continues with the first missing shard. With ``precompute.mode: online`` the same plan is recorded without
scoring or writing a shard (the target loads only to regenerate answers): training scores the shards beside the
head (``mtp_train.features.online``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mtp_train.errors import UserError
from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.lock import directory_lock, exclusive, merge_lock, rank_lock, shared
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.threads import set_threads, warn_if_oversubscribed
from mtp_train.data.dataset import LoadedData, Row, encode_many, heldout_ids, load_rows
from mtp_train.features.index import RankIndex, index_name, load_index
from mtp_train.features.layers import eagle3_layers, stored_layers
from mtp_train.features.space import bytes_per_token, require_space
from mtp_train.features.tensors import HIDDEN_DTYPES
from mtp_train.features.manifest import (
    MERGED,
    Manifest,
    data_fingerprint,
    load_manifest,
    rank_manifest_name,
    target_fingerprint,
    text_fingerprint,
    tokenizer_fingerprint,
)
from mtp_train.precompute.directory import merge_manifests, prepare_directory
from mtp_train.precompute.preflight import check_data_files, check_rows, mask_counts
from mtp_train.precompute.shards import Encoded, ShardPlan, plan_shards, record_plan, save_rank, write_shards
from mtp_train.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from mtp_train.models.tp import TensorParallel
    from mtp_train.runtime.engine import Engine


@dataclass(frozen=True)
class Worker:
    rank: int
    world: int


@dataclass(frozen=True)
class Job:
    """What one worker precomputes: the recipe, the worker, and the fingerprint its features must carry."""

    recipe: Recipe
    worker: Worker
    tokenizer: Any
    cfg: ModelConfig
    settings: dict
    fingerprint: dict[str, str]

    @property
    def out(self) -> Path:
        return self.recipe.features_dir

    @property
    def manifest_path(self) -> Path:
        return self.out / rank_manifest_name(self.worker.rank)


def run_precompute(
    recipe: Recipe, rank: int | None = None, world: int | None = None, overwrite: bool = False
) -> Manifest:
    """This worker's features, written and recorded in its manifest (or the merged manifest, when it is complete
    and matches the recipe already)."""
    from mtp_train.runtime.device import default_device
    from mtp_train.models.tp import init_tensor_parallel

    start = time.perf_counter()
    set_threads(recipe.threads)
    job = describe_job(recipe, resolve_worker(rank, world, recipe.target.tp))
    merged = None if overwrite else complete_features(job)
    if merged is not None:
        return merged
    device = default_device()
    tp = init_tensor_parallel(recipe.target.tp, device)
    rank = job.worker.rank
    # The TP group's leader alone writes this worker's files; it holds them until the end, and the directory with the
    # other ranks of its job only (same world size and fingerprint): another layout's ranks would drop its manifests.
    with ExitStack() as holds:
        if tp.is_leader:
            holds.enter_context(shared(directory_lock(job.out), f"precompute rank {rank}", *layout(job)))
            holds.enter_context(exclusive(rank_lock(job.out, rank), f"precompute rank {rank}", rank))
        return _precompute(job, device, tp, overwrite, start)


MERGE_WAIT_S = 60.0  # how long a rank waits for another to finish writing or dropping the merged manifest


def layout(job: Job) -> tuple[dict, str]:
    """The key the ranks of one precompute share a features directory by, and what it is in words."""
    digest = text_fingerprint(json.dumps(job.fingerprint, sort_keys=True))[:12]
    return ({"world_size": job.worker.world, "fingerprint": digest},
            f"a precompute of world size {job.worker.world} (features fingerprint {digest})")


def drop_merged(job: Job, overwrite: bool) -> None:
    """Remove the merged manifest, stale until every rank is complete again, under the merge lock (a rank merging now
    cannot write it back from manifests read before this rank dropped its own). One made with other settings or
    another world size is no rank's of this run to drop without ``--overwrite``."""
    path = job.out / MERGED
    with exclusive(merge_lock(job.out), f"precompute rank {job.worker.rank}", wait=MERGE_WAIT_S, point=None):
        if not path.is_file():
            return
        old = None if overwrite else load_manifest(path)
        if old is not None and old.fingerprint != job.fingerprint:
            why = (f"world size {old.world_size}" if old.world_size != job.worker.world else
                   "other settings or inputs")
            raise UserError(f"{path}: features made with {why} are complete here; rerun with --overwrite to replace "
                            "them, or give this run another output directory")
        path.unlink()


def _precompute(job: Job, device: torch.device, tp: TensorParallel, overwrite: bool, start: float) -> Manifest:
    """Score this worker's rows into shards from where an earlier run stopped, and record them; online, record the
    shards planned, unscored (training scores them)."""
    recipe = job.recipe
    online = recipe.precompute.mode == "online"
    old = resume_point(job, tp, overwrite)
    data = load_data(job)
    # online, the target runs here only to regenerate answers: training scores the shards
    engine = load_engine(recipe, device, tp) if recipe.data.regenerate or not online else None
    rows = rows_to_score(job, data, engine, tp)
    encoded = encode_many(job.tokenizer, [r.content for r in rows], recipe.data.max_length, [r.row_id for r in rows])
    by_file = mask_counts(data, rows, encoded)
    manifest, index = old or new_manifest(job, data, encoded)
    plan = plan_shards(rows, encoded, recipe.precompute.shard_tokens, manifest, index, job.out)
    if tp.is_leader and len(manifest.shards) < len(plan):
        drop_merged(job, overwrite)  # stale until every rank is complete again
    report_plan(job, plan, manifest, by_file)
    if online:
        if tp.is_leader:
            record_plan(plan, manifest, index, job.out, job.worker.rank)
        return finish(job, manifest, index, start) if tp.is_leader else manifest
    remaining = sum(plan.tokens(i) for i in range(len(manifest.shards), len(plan)))
    per_token = bytes_per_token(len(manifest.layers), manifest.hidden_size, manifest.topk, recipe.precompute.hidden_dtype)
    require_space(job.out, remaining * per_token,
                  f"rank {job.worker.rank}'s {len(plan) - len(manifest.shards)} shards still to write")
    if not recipe.data.regenerate:
        warn_if_oversubscribed("precompute", tp.is_leader)
    write_shards(plan, manifest, index, engine, job.out, job.worker.rank, write=tp.is_leader)
    return finish(job, manifest, index, start) if tp.is_leader else manifest


def check_recipe(recipe: Recipe, cfg: ModelConfig) -> None:
    """Precompute's refusals that the recipe and the target's config (``cfg``) decide alone, which
    ``mtp_train.pipeline.check_recipe`` makes before any stage runs: the aux layers it stores for an eagle3 or dflash
    head (``recipe_settings``), and the attention backend of the target's engine where precompute runs it (offline,
    or to regenerate answers)."""
    from mtp_train.runtime.attention import check_latent

    eagle3_layers(recipe, cfg)
    if recipe.data.regenerate or recipe.precompute.mode != "online":
        check_latent(recipe.target.attention_backend, cfg.torch_only)


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
        # only where they differ from what older features were made with, so that those keep their fingerprint
        **({"hidden_dtype": p.hidden_dtype} if p.hidden_dtype != "bf16" else {}),
        **({"mode": p.mode} if p.mode != "offline" else {}),
    }


def describe_job(recipe: Recipe, worker: Worker) -> Job:
    """The tokenizer, the target's config, and the fingerprint of everything the features depend on."""
    target = recipe.target.path
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
    return Job(recipe, worker, tokenizer, cfg, settings, fingerprint)


def complete_features(job: Job) -> Manifest | None:
    """The merged manifest, when it is complete and matches the recipe: nothing is left to do."""
    if not (job.out / MERGED).is_file():
        return None
    merged = load_manifest(job.out / MERGED)
    if merged.complete and merged.fingerprint == job.fingerprint:
        print(f"precompute: {job.out / MERGED} is complete and matches the recipe; skipped", file=sys.stderr)
        return merged
    return None


def resume_point(job: Job, tp: TensorParallel, overwrite: bool) -> tuple[Manifest, RankIndex] | None:
    """Prepare the directory and return this rank's manifest and index to continue from, if any.

    Under TP every rank runs the same forwards, but only the leader touches the directory."""
    old = None
    if tp.is_leader:
        old = prepare_directory(job.out, job.worker.rank, job.fingerprint, job.settings, overwrite)
    if tp.size > 1:
        torch.distributed.barrier()
        if not tp.is_leader and job.manifest_path.is_file():
            old = load_manifest(job.manifest_path)
    if old is None:
        return None
    shards = old.shards
    return old, load_index(job.out / index_name(job.worker.rank), [s.num_seqs for s in shards],
                           [s.num_tokens for s in shards])


def load_data(job: Job) -> LoadedData:
    """This worker's block of the dataset's rows, checked (no other row is converted)."""
    d = job.recipe.data
    data = load_rows(d.train, d.format, d.skip_bad_rows, d.max_rows, (job.worker.rank, job.worker.world))
    check_rows(data, job.tokenizer, str(job.recipe.target.path))
    return data


def load_engine(recipe: Recipe, device: torch.device, tp: TensorParallel) -> Engine:
    from mtp_train.runtime.device import resolve_dtype
    from mtp_train.runtime.engine import Engine

    return Engine.for_target(recipe.target, resolve_dtype(recipe.target.dtype, device), device, tp,
                             max_batch_tokens=recipe.precompute.batch_tokens)


def rows_to_score(job: Job, data: LoadedData, engine: Engine | None, tp: TensorParallel) -> list[Row]:
    """This worker's rows; with ``data.regenerate``, their assistant turns answered by the target."""
    rows = data.rows
    d = job.recipe.data
    if not d.regenerate:
        return rows
    from mtp_train.data.answers import AnswerFile, regenerated_path, regeneration_key
    from mtp_train.precompute.regenerate import regenerate

    regen_key = regeneration_key(job.fingerprint, d.sampling.model_dump(), d.max_length)
    warn_if_oversubscribed("precompute", tp.is_leader)  # before the long regeneration
    answers = AnswerFile(regenerated_path(job.out, job.worker.rank), regen_key, write=tp.is_leader)
    return regenerate(rows, job.tokenizer, engine, d.sampling, max_length=d.max_length, file=answers)


def new_manifest(job: Job, data: LoadedData, encoded: list[Encoded]) -> tuple[Manifest, RankIndex]:
    """The manifest and index of a rank that has written no shard yet."""
    recipe = job.recipe
    mine = [r.row_id for r in data.rows]
    heldout = heldout_ids(data.num_rows, recipe.data.heldout_rows, recipe.seed)
    manifest = Manifest(
        ranks=[job.worker.rank], world_size=job.worker.world, fingerprint=job.fingerprint, settings=job.settings,
        layers=stored_layers(recipe, job.cfg), hidden_size=job.cfg.hidden_size,
        hidden_dtype=HIDDEN_DTYPES[recipe.precompute.hidden_dtype], online=recipe.precompute.mode == "online",
        topk=recipe.precompute.topk, regenerated=recipe.data.regenerate,
        sampling=recipe.data.sampling.model_dump() if recipe.data.regenerate else None,
        num_rows=len(mine), heldout_row_ids=[i for i in mine if i in heldout],
        skipped_rows=[{"file": f, "index": i, "why": w} for f, i, w in data.bad_rows],
        truncated_rows=sum(t for _, _, t in encoded),
    )
    return manifest, RankIndex(np.asarray(mine, np.int64), [], [])


def report_plan(job: Job, plan: ShardPlan, manifest: Manifest, by_file: dict[str, list[int]]) -> None:
    """What this rank will score, and how much of each data file's tokens are masked in."""
    masked, total = (sum(c[i] for c in by_file.values()) for i in (0, 1))
    w = job.worker
    print(f"precompute: rank {w.rank}/{w.world}, {len(plan.rows)} rows, {total:,} tokens "
          f"({masked / total:.1%} masked in, {manifest.truncated_rows} truncated to {job.recipe.data.max_length}), "
          f"{len(plan)} shards, {len(manifest.shards)} already done", file=sys.stderr)
    for path, (file_masked, file_total) in by_file.items():
        print(f"precompute: {path}: {file_masked / file_total:.1%} of its tokens masked in", file=sys.stderr)


def finish(job: Job, manifest: Manifest, index: RankIndex, start: float) -> Manifest:
    """Mark this rank complete (its shards were read back as they landed: ``write_shards``), and merge the
    manifests once every rank is."""
    manifest.complete = True
    save_rank(job.out, job.worker.rank, manifest, index)
    out, world = job.out, job.worker.world
    with exclusive(merge_lock(out), f"precompute rank {job.worker.rank}", wait=MERGE_WAIT_S, point=None):
        merged = merge_manifests(out, world)
    totals = manifest.totals()
    what = (f"planned {totals['tokens']:,} tokens in {len(manifest.shards)} shards for online training (nothing "
            "stored)" if manifest.online else f"wrote {totals['tokens']:,} tokens in {len(manifest.shards)} shards, "
            f"{totals['bytes_per_token']} bytes/token")
    print(f"precompute: rank {job.worker.rank} {what}, {time.perf_counter() - start:.0f}s"
          + (f"; {out / MERGED} covers all {world} rank(s)" if merged else "; waiting for other ranks"))
    return manifest
