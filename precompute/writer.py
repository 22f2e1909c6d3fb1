"""Shard writing on a background thread: temp file, fsync, rename, then the manifest update.

The queue is bounded: when the writer falls behind, ``submit`` blocks the producer (the next
forward waits) and nothing is ever dropped. Shards are written and recorded strictly in order.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

CRASH_ENV = "MTP_TRAIN_CRASH_AT"  # test hook: "point:shard_index" kills the process there with SIGKILL


def crash_point(point: str, shard_index: int) -> None:
    """Die like a killed job at ``point`` for ``shard_index`` when the test hook asks for it."""
    if os.environ.get(CRASH_ENV) == f"{point}:{shard_index}":
        os.kill(os.getpid(), signal.SIGKILL)


def write_atomic(path: Path, payload: bytes, shard_index: int = -1) -> None:
    """Write ``payload`` to ``path`` via a hidden temp file in the same directory, fsync'd, then rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        half = len(payload) // 2
        f.write(payload[:half])
        crash_point("write", shard_index)
        f.write(payload[half:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class ShardWriter:
    """Writes ``(path, tensors, metadata)`` jobs in order on one thread, then calls ``on_written``."""

    def __init__(self, on_written: Callable[[int, Path, str, int], None], queue_depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._on_written = on_written
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is not None:
                continue  # drain after a failure; close() re-raises it
            index, path, tensors, metadata = job
            try:
                payload = safetensors_bytes(tensors, metadata=metadata)
                write_atomic(path, payload, index)
                crash_point("manifest", index)
                self._on_written(index, path, hashlib.sha256(payload).hexdigest(), len(payload))
            except BaseException as e:  # surfaced to the producer
                self._error = e

    def submit(self, index: int, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((index, path, tensors, metadata))  # blocks when the queue is full

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
