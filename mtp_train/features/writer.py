"""Shard writing on a background thread: temp file, fsync, rename, then the manifest update.

The queue is bounded: when the writer falls behind, ``submit`` blocks the producer (the next
forward waits) and nothing is ever dropped. Shards are written and recorded strictly in order.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from mtp_train.io import crash_point, write_atomic
from mtp_train.threads import leave_signals_to_main_thread


class ShardWriter:
    """Writes ``(path, tensors, metadata)`` jobs in order on one thread, then calls ``on_written``."""

    def __init__(self, on_written: Callable[[int, Path, str, int], None], queue_depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._on_written = on_written
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        leave_signals_to_main_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is not None:
                continue  # drain after a failure; close() re-raises it
            index, path, tensors, metadata = job
            try:
                payload = safetensors_bytes(tensors, metadata=metadata)
                write_atomic(path, payload, crash_index=index)
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
