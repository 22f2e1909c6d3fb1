"""The machine a run is on, as figures that bound a decode step: the CPU's model and the instruction-set flags the
kernels use, and the memory read bandwidth the weights stream at.

A CPU decode step at a small batch reads every weight once, so its floor is the weights' bytes over the read
bandwidth; that bandwidth, not another library's speed, is the stable reference a step time is held against
(``bench/runtime_bench.py``). The eval's report and every bench name the CPU (``describe``), so that no figure
is compared with one from another machine.
"""

from __future__ import annotations

import os
import platform
import time
from functools import cache
from pathlib import Path

import torch

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "sve", "asimd")
READ_BYTES = 2**30  # the buffer the read bandwidth is measured over: far beyond any cache of a 2026 CPU's share


@cache
def cpu_model() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and which of ``FLAGS`` it has (from /proc/cpuinfo; the platform's name elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), ()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.machine(), tuple(f for f in FLAGS if f in flags)


def read_bandwidth(nbytes: int = READ_BYTES, repeats: int = 5) -> float:
    """Bytes per second a ``sum`` over ``nbytes`` of float32 reads at torch's current thread count (the best of
    ``repeats`` after one untimed pass)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def describe() -> str:
    """One line: the CPU, its flags, the cores this process may use, or the GPU."""
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name()}"
    model, flags = cpu_model()
    return (f"cpu: {model} ({', '.join(flags) or 'none of the listed flags'}), {len(os.sched_getaffinity(0))} cores "
            f"usable, {torch.get_num_threads()} threads")
