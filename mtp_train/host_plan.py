"""What each SLURM job asks of its node's host: CPUs and memory, from the recipe's plan (``mtp-train slurm``).

Without them, a site's defaults apply, which are often one CPU and a few GiB. Per process (a TP rank of a precompute
or eval task, a training rank) the plan counts an allowance for the CUDA context, torch, NCCL and Python
(``PROCESS_BYTES``), and ``threads`` CPUs (``recipe.threads``, else ``THREADS_PER_GPU``) plus one for the loading or
writing thread beside them. On top come the stage's own bytes:

- **precompute**: the dataset's rows as Python objects (every task reads the data: ``ROWS_PER_FILE_BYTE`` times the
  files' size), and the shards in flight (``SHARDS_IN_FLIGHT``), each in the bytes it stores: ``Engine.score``
  stores each batch's hidden states (bf16, or FP8) before they reach the host;
- **train**: on each rank the frozen embedding and lm_head in fp32 (loaded on the host first) and the batches in
  flight (the one training, the one the loading thread reads ahead, a validation batch); offline, the page cache
  of the shard files its loader reads ahead (``mtp_train.train.data.read_ahead_bytes``: where SLURM caps a job's
  memory, page cache counts against the cap); online, the scored shards it holds (a window per micro-batch lane
  and TP rank, plus ``precompute.online_cache_gb``; a rank converts only the rows of its own windows);
- **eval**: the rows again (the held-out prompts are read from the data), and a small prompt set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mtp_train.features.layers import stored_layers
from mtp_train.features.space import bytes_per_token
from mtp_train.head_memory import batch_bytes, frozen_bytes
from mtp_train.train.data import SHARD_WINDOW, read_ahead_bytes
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe

GIB = 2**30
PROCESS_BYTES = 6 * GIB  # CUDA context and caching host allocator, torch, NCCL buffers, Python
THREADS_PER_GPU = 8
ROWS_PER_FILE_BYTE = 10  # a chat dataset as Python objects, over its compressed (gzip) or plain size on disk
# the one being scored, two in the writer's queue (its queue_depth), and the one being written, held three times at
# its peak (its tensors, safetensors' buffer and the file's bytes made from it)
SHARDS_IN_FLIGHT = 6


@dataclass(frozen=True)
class HostPlan:
    """A job's node: CPUs and bytes of memory."""

    cpus: int
    memory: int


def _threads(recipe: Recipe) -> int:
    return recipe.threads or THREADS_PER_GPU


def _rows_bytes(recipe: Recipe) -> int:
    return ROWS_PER_FILE_BYTE * sum(p.stat().st_size for p in recipe.data.train if p.is_file())


def precompute_host(recipe: Recipe, cfg: ModelConfig) -> HostPlan:
    tp = recipe.target.tp
    p = recipe.precompute
    per_token = bytes_per_token(len(stored_layers(recipe, cfg)), cfg.hidden_size, p.topk, p.hidden_dtype)
    # and the scored shard's top-K as score() returns it (float32 log-probs, int64 ids) beside its stored copy
    shards = (SHARDS_IN_FLIGHT * per_token + 12 * p.topk) * p.shard_tokens
    return HostPlan(tp * (_threads(recipe) + 1), tp * PROCESS_BYTES + _rows_bytes(recipe) + shards)


def train_host(recipe: Recipe, cfg: ModelConfig, procs: int) -> HostPlan:
    batch = batch_bytes(recipe, cfg, len(stored_layers(recipe, cfg)))
    per_rank = PROCESS_BYTES + frozen_bytes(cfg) + 3 * batch
    p = recipe.precompute
    shard = p.shard_tokens * bytes_per_token(len(stored_layers(recipe, cfg)), cfg.hidden_size, p.topk, p.hidden_dtype)
    if p.mode == "online":  # the scored shards: each lane's window (of every rank of a TP group), and the cache
        windows = recipe.train.grad_accum * recipe.target.tp * SHARD_WINDOW * shard
        per_rank += windows + int(p.online_cache_gb * GIB)
    else:  # the shard files asked to be read ahead, in the page cache
        per_rank += read_ahead_bytes(shard, recipe.train.grad_accum)
    return HostPlan(procs * (_threads(recipe) + 1), procs * per_rank)


def eval_host(recipe: Recipe) -> HostPlan:
    tp = recipe.target.tp
    return HostPlan(tp * (_threads(recipe) + 1), tp * PROCESS_BYTES + _rows_bytes(recipe) + GIB)


def job_hosts(recipe: Recipe, train_procs: int, cpus_per_task: int | None) -> dict[str, tuple[int, int]]:
    """``(cpus, memory)`` of each GPU job's node (``cpus_per_task``, the ``--cpus-per-task`` flag, wins); none
    where this node cannot read the target's config (then the site's defaults apply)."""
    config = recipe.target.path / "config.json"
    if not config.is_file():
        return {}
    cfg = ModelConfig.from_hf(json.loads(config.read_text()), str(config))
    plans = {"precompute": precompute_host(recipe, cfg), "train": train_host(recipe, cfg, train_procs),
             "eval": eval_host(recipe)}
    return {job: (cpus_per_task or plan.cpus, plan.memory) for job, plan in plans.items()}
