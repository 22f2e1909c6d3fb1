"""Progress of a long stage: a tqdm bar on a terminal, plain log lines at a steady interval everywhere else.

tqdm draws nothing useful into a log file (nohup, SLURM, CI), so when stderr is not a terminal a stage prints one
line every ``every`` seconds instead (default 30; the ``MTP_TRAIN_PROGRESS_EVERY`` variable sets it, 0 prints on
every update)::

    precompute: 49,152/3,240,000 tokens (1.5%), shard 1/13, 812 tok/s, ETA 1h05m

On a terminal or not, the stage ends with one line that keeps its totals::

    precompute: 3,240,000/3,240,000 tokens in 1h06m, shard 13/13, 815 tok/s
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from mtp_train.errors import UserError

EVERY_ENV = "MTP_TRAIN_PROGRESS_EVERY"
DEFAULT_EVERY = 30.0


def interval() -> float:
    """Seconds between log lines: ``MTP_TRAIN_PROGRESS_EVERY``, else 30."""
    raw = os.environ.get(EVERY_ENV, "")
    try:
        every = float(raw) if raw else DEFAULT_EVERY
    except ValueError:
        every = -1.0
    if not every >= 0:
        raise UserError(f"{EVERY_ENV}={raw!r}: give the seconds between progress lines, e.g. 30 (0: every update)")
    return every


def duration(seconds: float) -> str:
    """``45s``, ``4m12s``, ``2h03m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """``done`` of ``total`` ``unit`` (rows, tokens, steps, prompts) since ``initial``; ``tokens`` counted apart.

    ``enabled=False`` (a rank that is not the leader) prints nothing. ``summary=False`` leaves the final line to
    the caller (an eval sweep point has its own). ``note`` follows the counts (a loss, a shard number).
    """

    def __init__(self, stage: str, total: int, unit: str, *, initial: int = 0, enabled: bool = True,
                 summary: bool = True, every: float | None = None, stream: TextIO | None = None) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.done, self.tokens, self.note = initial, 0, ""
        self.enabled, self.summary = enabled, summary
        self._initial = initial
        self._stream = stream if stream is not None else sys.stderr
        self._every = every if every is not None else interval()
        self._start = self._shown = time.perf_counter()
        self._bar: Any = None  # a tqdm bar, on a terminal
        if enabled and self._stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit=f" {unit}", desc=stage, file=self._stream,
                             leave=False, dynamic_ncols=True)

    def update(self, n: int = 0, tokens: int = 0, note: str | None = None) -> None:
        """``n`` more units done and ``tokens`` more tokens processed; ``note`` replaces the last one."""
        self.done += n
        self.tokens += tokens
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            self._bar.set_postfix_str(", ".join(([self.note] if self.note else []) + self._rate(elapsed)),
                                      refresh=False)
            return
        now = time.perf_counter()
        if now - self._shown >= self._every:
            self._shown = now
            print(self.line(now), file=self._stream, flush=True)

    def close(self) -> None:
        """Remove the bar and print the totals line (unless ``summary`` is off)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.enabled and self.summary:
            print(self.line(time.perf_counter(), final=True), file=self._stream, flush=True)
        self.enabled = False  # a second close prints nothing

    def line(self, now: float, final: bool = False) -> str:
        """The log line: counts, the note, tokens/s and, unless ``final``, the percentage and ETA."""
        elapsed = max(now - self._start, 1e-9)
        head = f"{self.stage}: {self.done:,}/{self.total:,} {self.unit}"
        if final:
            parts = [f"{head} in {duration(elapsed)}"]
        else:
            parts = [f"{head} ({self.done / self.total:.1%})" if self.total else head]
        parts += [self.note] if self.note else []
        parts += [f"{self.tokens:,} tokens"] if self.tokens and self.unit != "tokens" else []
        parts += self._rate(elapsed)
        if not final:
            speed = (self.done - self._initial) / elapsed
            parts.append(f"ETA {duration((self.total - self.done) / speed)}" if speed > 0 else "ETA unknown")
        return ", ".join(parts)

    def _rate(self, elapsed: float) -> list[str]:
        return [f"{self.tokens / elapsed:,.0f} tok/s"] if self.tokens else []
