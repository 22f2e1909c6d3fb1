"""Device and dtype choices shared by every stage that runs a model."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A recipe's ``target.dtype``: ``auto`` is bfloat16 on CUDA and float32 elsewhere (bf16 is slow on CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock reading around it measures that work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
