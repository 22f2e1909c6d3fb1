"""Counting host syncs on a real GPU, per decode step: the budget of ``docs/runtime.md`` checked where it matters.

``cuda_syncs()`` records every synchronizing CUDA call torch makes (a device tensor read on the host with ``item``,
``tolist``, ``bool`` or ``.cpu()``; a blocking or pageable copy; ``torch.cuda.synchronize``; an op whose output size
depends on the data), through torch's sync debug mode. FlashInfer's ``plan`` is seen where it calls torch (its
copies of the index arrays: from the runtime's pinned host arrays, none waits); what its C++ planner does is not,
and in 0.6.6 that is one ``cudaMemcpyAsync`` from page-locked memory (``attention/scheduler.cuh``), no sync.
``bench/gpu_kernels.py`` counts the syncs of each kind of plan on a GPU. ``most_per_call`` wraps methods of one object and keeps, per method, the most syncs one
call made. On a GPU::

    with cuda_syncs() as syncs, most_per_call(decoder, ("_spec_step", "_plain_step"), lambda: syncs.count) as most:
        decoder.generate(prompts, params)
    assert most["_spec_step"] <= SYNC_BUDGET

and ``most_per_call(engine, ("step",), ...)`` around ``engine.generate`` for plain decoding (its first step is the
prefill). The tests count the same way on the fake CUDA device (``tests/fake_cuda.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

SYNC_BUDGET = 3  # host syncs allowed in one speculative step, and in one plain decode step, at any batch and k
_MESSAGE = "synchronizing CUDA operation"


class SyncRecord:
    """The synchronizing calls seen so far (``count``; ``messages``, the warnings torch gave for them)."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self._caught = caught

    @property
    def messages(self) -> list[str]:
        return [str(w.message) for w in self._caught if _MESSAGE in str(w.message)]

    @property
    def count(self) -> int:
        return len(self.messages)


@contextlib.contextmanager
def cuda_syncs() -> Iterator[SyncRecord]:
    """Within: torch warns on each synchronizing CUDA call, and the yielded record counts them (CUDA builds only)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield SyncRecord(caught)
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def most_per_call(obj: object, names: tuple[str, ...], count: Callable[[], int]) -> Iterator[dict[str, int]]:
    """Within: each call of ``obj``'s methods ``names`` is measured by ``count()`` (syncs so far) before and after;
    the yielded dict holds, per name, the most one call made (0 until called)."""
    most = dict.fromkeys(names, 0)

    def wrap(name: str, method: Callable) -> Callable:
        def counted(*args, **kwargs):
            before = count()
            out = method(*args, **kwargs)
            most[name] = max(most[name], count() - before)
            return out

        return counted

    for name in names:
        setattr(obj, name, wrap(name, getattr(obj, name)))
    try:
        yield most
    finally:
        for name in names:
            delattr(obj, name)  # the instance attribute goes; the class's method shows again
