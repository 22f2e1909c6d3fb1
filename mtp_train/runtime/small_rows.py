"""The CPU small-row matmul kernel (``small_rows.cpp``): built on first use, or ``None`` where it cannot be.

The kernel multiplies 1..``MAX_ROWS`` rows by a weight packed once (``pack``), reading the weight once for all rows;
``runtime/small_batch.py`` measures where it beats BLAS and gives those weights a packed copy. It is compiled with
``torch.utils.cpp_extension`` (g++ and ninja, both installed with the project's environment) for this machine
(``-march=native``) into ``$XDG_CACHE_HOME/mtp-train/`` (``~/.cache`` by default; ``MTP_TRAIN_KERNEL_DIR``
overrides it), keyed by the source, torch's version and the CPU's instruction set, so a build is reused and never
loaded on a machine it was not built for. Where the build fails (no compiler, say), one warning names the reason
and the engine runs on BLAS alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("small_rows.cpp")
MAX_ROWS = 8
log = logging.getLogger(__name__)


def build_dir() -> Path:
    if override := os.environ.get("MTP_TRAIN_KERNEL_DIR"):
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp-train"


@cache
def kernel() -> object | None:
    """The loaded ops (``kernel().pack``, ``kernel().linear``), or ``None`` where the kernel cannot be built."""
    from torch.utils.cpp_extension import load

    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {platform.machine()} "
                         f"{torch.backends.cpu.get_cpu_capability()}".encode()).hexdigest()[:12]
    where = build_dir() / f"small_rows-{key}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        load(name="mtp_small_rows", sources=[str(SOURCE)], build_directory=str(where), is_python_module=False,
             extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as err:  # a missing compiler or ninja: BLAS alone still runs everything
        log.warning("CPU small-row kernel not built in %s (%s); decode runs on BLAS alone",
                    where, str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        return None
    return torch.ops.mtp_small_rows


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> its packed copy ``[ceil(N / 32), K, 32]`` for ``linear``."""
    return kernel().pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K]`` (M <= ``MAX_ROWS``) times the packed weight -> ``[M, out_features]``."""
    return kernel().linear(x.contiguous(), packed, out_features)


if __name__ == "__main__":  # `make venv` builds it once, so that the first engine does not wait for g++
    print(f"CPU small-row kernel: {'built' if kernel() is not None else 'not built, BLAS alone'} ({build_dir()})")
