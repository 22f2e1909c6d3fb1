"""An exclusive hold on what a stage writes: a lock file that works on the shared file systems clusters use.

The lock is a file that records who holds it: host, pid, the process's start time, the SLURM job and restart count,
and the command. It is written whole under a name of its own and then hard-linked to the hold's name, which fails
when that name exists: the classic lock of NFS, atomic there and on Lustre, where ``flock`` often is not, and a
hold is never seen half-written. A second writer refuses in one line naming the holder. A hold whose process is
gone is taken over with a one-line notice: on this host when its pid is no longer that process (gone, or reused),
and from another host when it is an earlier run of this same SLURM job (a requeue). The hold is released when the
stage ends, however it ends but a kill.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.io import fsync_dir, pause_point

TAKEOVER_STALE_S = 60.0  # a takeover marker older than this was left by a process killed while taking over


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat``), None when there is no such
    process; "" where ``/proc`` cannot tell (the pid alone then says whether it lives)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""


def _me() -> dict[str, str | int]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()) or "",
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:300]}


def _read(path: Path) -> dict | None:
    """The holder a hold file records, None when there is no file, {} when it is not a record."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _gone(holder: dict) -> bool:
    """Whether the holder's process is known to be gone: a pid on this host that is no longer that process, or, on
    another host, an earlier run of this SLURM job."""
    me = _me()
    if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int):
        start = _start_time(holder["pid"])
        return start is None or bool(start and holder.get("start") and start != holder["start"])
    return bool(holder.get("slurm_job")) and holder.get("slurm_job") == me["slurm_job"] \
        and holder.get("slurm_restart") != me["slurm_restart"]


def _describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')} "
            f"(`{holder.get('command', '?')}`)")


def _create(path: Path, record: dict) -> bool:
    """Make ``path`` hold ``record`` unless it exists; whether it was made. The record is written whole under a name
    of this process's own and hard-linked to ``path`` (``link`` fails on an existing name, atomically, NFS too)."""
    mine = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    with open(mine, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(mine, path)
    except FileExistsError:
        return False
    finally:
        mine.unlink()
    fsync_dir(path.parent)
    return True


def _take_over(path: Path, stale: dict, what: str) -> None:
    """Remove the stale hold ``path`` (still the one read as ``stale``), one process at a time: the takeover itself
    is a hold (``path.takeover``), so that two processes that both saw the stale hold cannot both take it."""
    marker = path.with_name(path.name + ".takeover")
    if not _create(marker, _me()):
        try:
            if time.time() - marker.stat().st_mtime < TAKEOVER_STALE_S:
                return  # another process is taking it over now: the caller tries again
            marker.unlink()
        except FileNotFoundError:
            pass
        return
    try:
        if _read(path) == stale:
            path.unlink()
            print(f"mtp-train: {what}: taking over {path} from {_describe(stale)}, whose process is gone",
                  file=sys.stderr)
    finally:
        marker.unlink(missing_ok=True)


def acquire(path: Path, what: str, timeout: float = 30.0) -> dict:
    """Take the hold ``path`` for ``what`` (a stage and the directory it writes) and return its record; a live
    holder is a one-line :class:`UserError` naming it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = _me()
    deadline = time.monotonic() + timeout
    while not _create(path, record):
        holder = _read(path)
        if holder is None:
            continue  # released between the two calls
        if not holder:
            raise UserError(f"{what}: {path} is not a hold this tool wrote; delete it if no other run writes "
                            f"{path.parent}")
        if not _gone(holder):
            remedy = ("wait for it to end or stop it" if holder.get("host") == record["host"] else
                      f"wait for it to end or stop it; if that job is gone, delete {path}")
            raise UserError(f"{what}: {path.parent} is being written by {_describe(holder)}; {remedy}")
        _take_over(path, holder, what)
        if time.monotonic() > deadline:
            raise UserError(f"{what}: could not take over the stale hold {path} in {timeout:.0f} s; delete it")
        time.sleep(0.05)
    return record


def release(path: Path, record: dict) -> None:
    """Give the hold back, if it is still this process's."""
    if _read(path) == record:
        path.unlink(missing_ok=True)


def rank_lock(directory: Path, rank: int | None = None) -> Path:
    """The lock of one rank's writes in ``directory``: ``rank``, or this process's ``RANK`` (torchrun's), or 0."""
    return directory / f".lock.rank-{int(os.environ.get('RANK', '0')) if rank is None else rank:05d}"


@contextmanager
def exclusive(path: Path, what: str, index: int = 0) -> Iterator[None]:
    """Hold the lock ``path`` while the block runs; the folders made for it are removed after, where the block left
    them empty. The test hook's pause point ``hold:<index>`` comes right after the lock is taken, so that
    a test can start a second writer while the first holds it."""
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # the folders the lock will make
    record = acquire(path, what)
    try:
        pause_point("hold", index)
        yield
    finally:
        release(path, record)
        for folder in made:  # a stage that failed before writing anything leaves no folder behind
            try:
                folder.rmdir()
            except OSError:  # not empty: the stage wrote something there
                break
