"""The machine a bench ran on, in one line every bench prints first: the CPU's model and the flags that matter to the
kernels, the cores, the measured read bandwidth (a ``sum`` over 1 GiB at the bench's threads), and the versions of
the libraries it compares against, so that no figure is compared with one from another machine."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from mtp_train.runtime.machine import describe, read_bandwidth

REPO = Path(__file__).resolve().parents[1]


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def vllm_version() -> str | None:
    """vLLM's version in ``.venv-vllm`` (``make vllm``), read from its metadata without importing it; None without it."""
    found = sorted(REPO.glob(".venv-vllm/lib/python*/site-packages/vllm*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-")[1] if found else None


def machine_line(bandwidth: bool = True) -> str:
    """``machine: ...`` naming the CPU, its read bandwidth (measured now unless ``bandwidth`` is false) and versions."""
    read = f", read bandwidth {read_bandwidth() / 1e9:.1f} GB/s (sum over 1 GiB)" if bandwidth else ""
    vllm = vllm_version()
    libs = f"torch {torch.__version__}, transformers {_version('transformers')}" + (f", vLLM {vllm}" if vllm else "")
    return f"machine: {describe()}{read}; {libs}"


def measured_on(devices: dict[str, str]) -> str:
    """The line a table of eval reports ends with: each report's label and the device it recorded."""
    return "measured on: " + "; ".join(f"{label}: {device}" for label, device in devices.items())
