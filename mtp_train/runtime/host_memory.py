"""Large host tensors come from the heap and reuse freed memory, instead of faulting in fresh pages each time.

glibc serves every allocation above its mmap threshold (at most 32 MiB by default) with a fresh ``mmap``, unmaps
it on free, and the first write to each page of the next one faults into the kernel, which zeroes it. A runtime
step allocates such tensors in every layer (a prefill's activations, a decode group's gathered K/V), so on the CPU
those faults cost as much as the work: a 93 MB K/V gather took 90 ms fresh and 34 ms in reused memory, and a
256-wide SmolLM2 regeneration ran 17% faster with this set, token for token the same. ``keep_freed_memory`` raises
the threshold to 1 GiB, stops trimming the heap and grows it 256 MiB at a time, much as the CUDA caching allocator
keeps device memory: the process holds its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc (nothing is changed)."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    settings = ((M_MMAP_THRESHOLD, 2**30), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 2**28))
    _done = all(mallopt(key, value) for key, value in settings)
    return _done
