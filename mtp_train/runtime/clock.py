"""Timing named regions of work queued on a device without making the host wait for it.

On CUDA each region is a pair of events recorded in the stream; ``settle`` waits once for the last of them (after a
run) and sums their elapsed times, so a timed step costs no host sync. On the CPU the host clock is read directly.
"""

from __future__ import annotations

import time

import torch


class RegionClock:
    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.open: dict[str, object] = {}
        self.spans: list[tuple[str, object, object]] = []  # (name, start event, end event) not yet read
        self.seconds: dict[str, float] = {}

    def _now(self) -> object:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, name: str) -> None:
        self.open[name] = self._now()

    def cancel(self, name: str) -> None:
        """Forget the open region ``name`` (it did no work worth counting)."""
        self.open.pop(name)

    def stop(self, name: str) -> None:
        begin, end = self.open.pop(name), self._now()
        if self.events:
            self.spans.append((name, begin, end))
        else:
            self.seconds[name] = self.seconds.get(name, 0.0) + end - begin

    def settle(self) -> dict[str, float]:
        """Seconds per region name since the last call (one wait for the device on CUDA)."""
        if self.spans:
            self.spans[-1][2].synchronize()
            for name, begin, end in self.spans:
                self.seconds[name] = self.seconds.get(name, 0.0) + begin.elapsed_time(end) / 1e3
        seconds, self.seconds, self.spans = self.seconds, {}, []
        return seconds
