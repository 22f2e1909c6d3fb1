"""Tensor-parallel group: which slice of the heads this rank owns, and the all-reduce after row-parallel layers."""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mtp_train.errors import UserError


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` ranks; ``size == 1`` means no communication at all. ``group`` is the process group
    (None: the default one, all processes) and ``src`` the global rank of its leader."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    src: int = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """The ``[start, stop)`` of ``n`` items (heads, channels) owned by this rank."""
        if n % self.size:
            raise UserError(f"target.tp: {self.size} does not divide the model's {n} {what}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of the group's ``value``s, on every rank (a tensor on ``device``: NCCL's or gloo's)."""
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Make every rank hold the leader's ``x`` (sampled tokens must agree across ranks)."""
        if self.size > 1:
            dist.broadcast(x, src=self.src, group=self.group)
        return x


def init_tensor_parallel(size: int, device: torch.device) -> TensorParallel:
    """Join the process group that ``torchrun`` set up (gloo on CPU, NCCL on CUDA), or run alone.

    On CUDA the rank's own GPU (``device``, from ``LOCAL_RANK``) becomes the current device first, so that NCCL
    and every ``cuda`` tensor of this rank land there rather than on GPU 0.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if size == 1:
        return TensorParallel()
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != size:
            raise UserError(f"target.tp: {size} needs {size} processes (torchrun --nproc_per_node {size}); got {world}")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type != "cuda":
            settle_gloo_at_exit()
    return TensorParallel(rank=dist.get_rank(), size=dist.get_world_size())


def settle_gloo_at_exit() -> None:
    """At exit, give gloo's worker threads a moment to drop the collectives they have finished (once per process).

    A gloo worker frees a finished collective's tensors after the caller's ``wait`` has returned; torch 2.13's tensors
    made in Python need the GIL to be freed, and a thread that asks for it once the interpreter is finalizing aborts
    the process ("terminate called without an active exception"), after every file was written. Measured with
    ``tests/tp_budget_worker.py`` (the tiny target's TP=2 decode on gloo): about one exit in 25 aborted without this
    pause, none in 200 with it."""
    global _settling
    if not _settling:
        _settling = True
        atexit.register(time.sleep, 0.05)


_settling = False


def tensor_parallel_groups(size: int, rank: int, world: int) -> tuple[TensorParallel, list[int]]:
    """Rank ``rank``'s tensor-parallel group when ``world`` processes (the default process group, already joined)
    form groups of ``size`` consecutive ranks (online training: each group scores together and its ranks train
    data-parallel), and the group's global ranks. Every process creates every group, in the same order."""
    if size == 1:
        return TensorParallel(), [rank]
    if world % size:
        raise UserError(f"target.tp: {size} does not divide the {world} training processes; launch a multiple of "
                        f"{size}")
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    first = rank - rank % size
    return TensorParallel(rank % size, size, groups[rank // size], first), list(range(first, first + size))
