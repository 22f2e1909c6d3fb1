"""The machine a bench ran on, in one line: CPU model, cores, the ISA flags that matter to the kernels, torch's
version and threads (and the GPU, where there is one), so that a figure is never compared across machines."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "sve", "asimd")


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``FLAGS`` it has (from /proc/cpuinfo; the platform's name elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    model, flags = platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model == platform.machine():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, [f for f in FLAGS if f in flags]


def machine_line() -> str:
    model, flags = cpu_model()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"machine: {model} ({', '.join(flags) or 'no listed flags'}), {len(os.sched_getaffinity(0))} cores "
            f"usable{gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads")
