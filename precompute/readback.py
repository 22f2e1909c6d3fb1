"""Each shard a worker wrote, read back from disk as it lands: what it wrote is what it hashed.

The writer hashes each shard's bytes as it writes them; this thread then reads the file back (after dropping its
pages from the page cache, so that the read comes from the disk, not from the pages just written) and checks its
size, sha256 and header against the manifest and index (``mtp_train.features.verify.check_shard``). It runs beside
the forwards of the next shards, so a worker's GPUs do not idle while its shards are hashed after its last one; a
shard that does not read back stops the run at the next shard (``check``) with one line naming it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.features.index import RankIndex
from mtp_train.features.manifest import Manifest
from mtp_train.features.verify import check_shard
from mtp_train.io import pause_point
from mtp_train.threads import leave_signals_to_main_thread

_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


class ShardReadBack:
    """Reads back, in order on one thread, the shards of rank ``rank``'s ``manifest`` it is given (``submit(s)``
    once shard ``s`` is recorded in the manifest and ``index``)."""

    def __init__(self, out: Path, manifest: Manifest, index: RankIndex, rank: int) -> None:
        self.out, self.manifest, self.index, self.rank = out, manifest, index, rank
        self.problems: list[str] = []
        self.checked = 0
        self.seconds = 0.0
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="shard-readback", daemon=True)
        self._thread.start()

    def submit(self, shard: int) -> None:
        self._queue.put(shard)

    def check(self) -> None:
        """Raise the one-line error once a shard has not read back as written."""
        if self.problems:
            raise UserError(f"rank {self.rank}'s shards do not read back as written ({len(self.problems)} of "
                            f"{self.checked}): {self.problems[0]}; check the disk, then rerun precompute with "
                            "--overwrite")

    def close(self, check: bool = True) -> None:
        """Wait for every shard submitted to be read back; with ``check``, raise if one did not read back, else say
        how many did."""
        self._queue.put(None)
        self._thread.join()
        if not check:
            return
        self.check()
        print(f"precompute: rank {self.rank} read back its {self.checked} shards as they landed: sha256 as written "
              f"({self.seconds:.0f}s of reading beside the forwards)", file=sys.stderr)

    def _run(self) -> None:
        leave_signals_to_main_thread()
        while (shard := self._queue.get()) is not None:
            pause_point("readback", shard)  # test hook: the shard is on disk, not yet read back
            began = time.perf_counter()
            entry = self.manifest.shards[shard]
            _drop_cached(self.out / entry.file)
            try:
                problem = check_shard(self.out, self.manifest, entry, self.index.rows_of(shard),
                                      self.index.shard_tokens[shard])
            except Exception as e:  # what check_shard does not name itself: still a shard not read back
                problem = f"{self.out / entry.file}: cannot be read back ({getattr(e, 'strerror', None) or e})"
            self.seconds += time.perf_counter() - began
            self.checked += 1
            if problem:
                self.problems.append(problem)


def _drop_cached(path: Path) -> None:
    """Drop the file's pages from the page cache (written and fsync'd, they are clean), so that reading it back
    reads the disk; only a hint."""
    if _DONTNEED is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # check_shard names a missing file
    try:
        os.posix_fadvise(fd, 0, 0, _DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
