"""Online training's target (``precompute.mode: online``): the runtime's engine beside the head, on the same device,
scoring the shards of an online plan (``mtp_train.features.online``) as the trainer's steps need them.

Each training process scores the windows of its own lanes, so that under DDP or DeepSpeed the ranks score
disjoint shards (when there are at least as many windows as lanes). With ``target.tp > 1`` the processes form
groups of ``tp`` consecutive ranks (``tensor_parallel_groups``): a group holds the target sharded over its ranks,
scores together the windows any of its ranks needs at a step, and each rank trains on its own batches of them.
The KV cache holds the largest scoring forward of the plan and nothing more (``OnlineFeatures.pages_needed``).
The step path only scores: ``ensure`` asks the encoding thread for the rows of the next windows
(``OnlineFeatures.prepare``), and ``score`` stores each batch's hidden states (bf16, or FP8) where it computed them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mtp_train.features.online import OnlineFeatures, Scorer
from mtp_train.features.tensors import hidden_storage
from mtp_train.models.tp import TensorParallel, tensor_parallel_groups
from mtp_train.recipe import Recipe
from mtp_train.runtime.device import resolve_dtype
from mtp_train.runtime.engine import Engine
from mtp_train.train.data import BatchPlan, plan_rank, plan_windows

if TYPE_CHECKING:
    from accelerate import Accelerator

PAGE_SIZE = 16  # the engine's default page


def scorer(engine: Engine, features: OnlineFeatures) -> Scorer:
    """What scores a shard's sequences for ``features``: ``engine.score`` of the plan's layers and top-K, each
    batch's hidden states stored as the plan stores them (``hidden_storage``) before they leave the device."""
    layers, topk = features.manifest.layers, features.manifest.topk
    store = hidden_storage(features.manifest.hidden_dtype)

    def score(sequences: list[list[int]]):
        with torch.inference_mode():
            return engine.score(sequences, layers=layers, topk=topk, store_hidden=store)

    return score


@dataclass
class OnlineScoring:
    """The target of this process's group and the plan of every rank in it: ``ensure(step)`` holds the shards of
    the windows that step's batches come from, for all of the group's ranks."""

    recipe: Recipe
    features: OnlineFeatures
    engine: Engine
    tp: TensorParallel
    members: list[int]  # the global ranks of this process's group (itself alone without TP)
    world: int
    per_epoch: int
    plans: dict[int, list[list[BatchPlan]]] = field(default_factory=dict)  # epoch -> member -> micro-batch lane

    @classmethod
    def start(cls, recipe: Recipe, features: OnlineFeatures, accelerator: Accelerator, per_epoch: int
              ) -> OnlineScoring:
        """Load the target on the accelerator's device (sharded over the group), and bind it to ``features``
        (which scores the held-out rows now)."""
        device, world = accelerator.device, accelerator.num_processes
        tp, members = tensor_parallel_groups(recipe.target.tp, accelerator.process_index, world)
        pages = features.pages_needed(recipe.precompute.batch_tokens, PAGE_SIZE)
        engine = Engine.from_pretrained(recipe.target.path, resolve_dtype(recipe.target.dtype, device), device, tp,
                                        backend=recipe.target.attention_backend, page_size=PAGE_SIZE, num_pages=pages,
                                        max_batch_tokens=recipe.precompute.batch_tokens)
        features.bind(scorer(engine, features))
        lanes, windows = world * recipe.train.grad_accum, len(plan_windows(features.train, recipe.seed, 0))
        if lanes > windows and accelerator.is_main_process:
            print(f"train: warning: online, {windows} shard window(s) for {lanes} lanes (processes x grad_accum): "
                  "every rank scores every window; lower precompute.shard_tokens to give each its own",
                  file=sys.stderr)
        return cls(recipe, features, engine, tp, members, world, per_epoch)

    def needed(self, step: int) -> list[str]:
        """The shard files of the windows that step ``step``'s batches of every rank of the group come from."""
        epoch, index = divmod(step, self.per_epoch)
        if epoch not in self.plans:
            t = self.recipe.train
            self.plans = {epoch: [plan_rank(self.features.train, t.batch_tokens, self.recipe.seed, epoch, member,
                                            self.world, t.grad_accum) for member in self.members]}
        return [name for lanes in self.plans[epoch] for plan in lanes for name in plan.window[index % len(plan)]]

    def upcoming(self, step: int) -> list[str]:
        """The shard files of the windows the group's lanes visit after those of step ``step``."""
        self.needed(step)
        epoch, index = divmod(step, self.per_epoch)
        return [name for lanes in self.plans[epoch] for plan in lanes for name in plan.ahead[index % len(plan)]
                if name not in plan.window[index % len(plan)]]

    def ensure(self, step: int) -> None:
        """Hold the shards step ``step`` reads (scored now where they are not), and have the next windows' rows
        encoded on the encoding thread meanwhile."""
        self.features.ensure(self.needed(step))
        self.features.prepare(self.upcoming(step))

    def summary(self, rank: int) -> str:
        """What this rank scored, for its log line."""
        f = self.features
        group = f" in a TP group of {self.tp.size} (ranks {self.members})" if self.tp.size > 1 else ""
        return (f"rank {rank}{group}: online: scored {f.scored} shard(s), {f.scored_tokens:,} tokens, in "
                f"{f.score_s:.0f}s; {f.held_bytes / 2**20:,.1f} MiB of features held at the end, 0 bytes stored")
