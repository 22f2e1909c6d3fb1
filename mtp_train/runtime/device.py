"""Device and dtype choices shared by every stage that runs a model."""

from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    """This process's GPU (``LOCAL_RANK`` under torchrun or srun, else 0) when CUDA is there, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A recipe's ``target.dtype``: ``auto`` is bfloat16 on CUDA and float32 elsewhere (bf16 is slow on CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock reading around it measures that work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``: on CUDA pinned and copied without making the host wait (a copy from pageable
    memory would), on the CPU itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
