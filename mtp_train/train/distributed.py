"""The processes of a training run: the accelerate ``Accelerator`` (DDP, or DeepSpeed ZeRO), each rank's optimizer
state as a checkpoint stores it, the stop request every rank agrees on, the ranks' weight digests and the
learning-rate schedule they all follow.

SIGUSR1 or SIGTERM (a SLURM time-limit warning or a preemption) asks for a stop: at the end of the current optimizer
step every rank agrees on it, a checkpoint is written, and the process exits with status 75 (``EXIT_STOPPED``).
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mtp_train.models.tp import settle_gloo_at_exit
from mtp_train.recipe import Recipe

if TYPE_CHECKING:
    from accelerate import Accelerator

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; run again to resume
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Set by SIGUSR1/SIGTERM; the trainer checks it between optimizer steps, never inside one."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        self.signal = signum

    def agreed(self, accelerator: Accelerator) -> bool:
        """True on every rank when any rank was signalled, so that all ranks stop after the same step."""
        flag = torch.tensor(1.0 if self.signal is not None else 0.0, device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum") > 0) if accelerator.num_processes > 1 else bool(flag)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train_precision(recipe: Recipe) -> str:
    """``train.mixed_precision`` resolved: ``auto`` is ``bf16`` on CUDA and ``no`` (fp32) elsewhere."""
    precision = recipe.train.mixed_precision
    return ("bf16" if torch.cuda.is_available() else "no") if precision == "auto" else precision


def make_accelerator(recipe: Recipe) -> Accelerator:
    """The recipe's accelerator: DDP (gloo without CUDA) or DeepSpeed ZeRO, with its mixed precision (TF32 matmuls
    where fp32 remains on CUDA)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs, InitProcessGroupKwargs

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # A head's buffers (rotary tables, the draft vocabulary) are constants, synced once when DDP wraps it. Broadcast
    # at every forward, as DDP does by default, they would be a collective per forward, and a rank whose batch runs
    # fewer (no document long enough for every unrolled step) would leave the ranks' collectives unmatched.
    kwargs: dict[str, Any] = {"mixed_precision": train_precision(recipe),
                              "kwargs_handlers": [DistributedDataParallelKwargs(broadcast_buffers=False)]}
    if recipe.train.engine == "deepspeed":
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29511"}.items():
            os.environ.setdefault(key, value)  # not launched: one process (DeepSpeed would look for MPI)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=recipe.train.zero_stage, gradient_accumulation_steps=recipe.train.grad_accum,
            gradient_clipping=recipe.train.grad_clip,
        )
    if not torch.cuda.is_available():
        if recipe.train.engine == "deepspeed":
            import deepspeed.ops

            # DeepSpeed's shared-memory all-reduce compiles C++ for minutes on first use; gloo does the job.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        else:
            kwargs["cpu"] = True  # (with cpu=True, accelerate would silently drop DeepSpeed)
            # accelerate imports DeepSpeed whenever it is installed (unwrap_model checks for its engine), and the
            # import warns "Setting accelerator to CPU ... unable to detect it" when it finds no GPU. Naming the CPU
            # silences that, and only here: without CUDA, under DDP, where DeepSpeed does no work.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # gloo, since NCCL needs CUDA
            kwargs["kwargs_handlers"].append(InitProcessGroupKwargs(backend="gloo"))
            settle_gloo_at_exit()
    # A second head trained in this process (``eval.compare``) gets its own plugin and precision: accelerate keeps
    # one state per process and refuses a second DeepSpeed plugin. The process group (PartialState) stays.
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(**kwargs)
    if recipe.train.engine == "deepspeed":  # batches are packed by tokens, so one "sample" per micro-batch
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    return accelerator


def optimizer_state(optimizer: torch.optim.Optimizer, zero: bool) -> dict[str, Any]:
    """This rank's optimizer state, tensors only. Under ZeRO: the base AdamW's state over this rank's
    flat partition, and that partition's fp32 master weights."""
    if not zero:
        return optimizer.state_dict()
    partitioned = optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    return {"base": partitioned.optimizer.state_dict(),
            "fp32": [t.detach().clone() for t in partitioned.single_partition_of_fp32_groups]}


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], zero: bool) -> None:
    """Load what ``optimizer_state`` returned on this rank into the prepared ``optimizer``."""
    if not zero:
        optimizer.load_state_dict(saved)
        return
    partitioned = optimizer.optimizer
    partitioned.optimizer.load_state_dict(saved["base"])
    for current, old in zip(partitioned.single_partition_of_fp32_groups, saved["fp32"], strict=True):
        current.data.copy_(old)


def rank_digests(accelerator: Accelerator, head: torch.nn.Module) -> list[str]:
    """Every rank's SHA-256 (hex) of its head's weights, so that anyone can check the replicas stayed identical."""
    digest = hashlib.sha256(b"".join(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                     for p in head.parameters())).digest()  # any dtype, bf16 too
    digests = accelerator.gather(torch.tensor(list(digest), dtype=torch.int64, device=accelerator.device))
    return [bytes(d.tolist()).hex() for d in digests.view(accelerator.num_processes, -1).cpu()]


def lr_factor(warmup: int, total: int, schedule: str = "cosine") -> Callable[[int], float]:
    """The learning-rate factor by step: linear warmup over ``warmup`` steps, then ``schedule``'s decay: ``cosine``
    to 10% at ``total``, or ``linear`` to 0 at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f
