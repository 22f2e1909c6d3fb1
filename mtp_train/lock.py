"""An exclusive hold on what a stage writes, and a shared hold on a directory: lock files that work on the shared
file systems clusters use.

A hold is a file that records who holds it: host, boot, pid namespace, pid, the process's start time, the SLURM job
and restart count, and the command. It is written whole under a name of its own and then hard-linked to the hold's
name, which fails when that name exists: the classic lock of NFS, atomic there and on Lustre, where ``flock`` often is
not, and a hold is never seen half-written. A second writer refuses in one line naming the holder. A hold whose
process is gone is taken over with a one-line notice: on this machine (the same host name, boot and pid namespace)
when its pid is no longer that process (gone, or reused), and from any other when it is an earlier run of this same
SLURM job (a requeue). Only one process removes a stale hold: the one that creates the takeover marker named after
it. The hold is released when the stage ends, however it ends but a kill.

A shared hold (``shared``) lets the processes of one job (the ranks of one precompute: same world size, same
fingerprint) write one directory together and keeps any other out: each member adds a file of its own recording the
job's key, then reads the others'; a live member with another key is refused (both are, if they start at once).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.io import fsync_dir, pause_point

RETRY_FIRST_S, RETRY_MAX_S = 0.01, 0.5  # the pause between two tries, doubled each try up to the most


def _machine() -> dict[str, str]:
    """What tells this machine and pid namespace from another of the same host name (two nodes named alike,
    containers sharing one): the kernel's boot id and the pid namespace's inode; "" where they cannot be read."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pid_ns = ""
    return {"host": socket.gethostname(), "boot_id": boot, "pid_ns": pid_ns}


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
    return {**_machine(), "pid": os.getpid(), "start": _start_time(os.getpid()) or "", "token": secrets.token_hex(8),
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


def _on_this_machine(holder: dict) -> bool:
    """Whether the holder ran on this machine, in this pid namespace, since this boot: only then does its pid say
    whether it lives. A hold that does not record them (an older tool's) counts as another machine's."""
    mine = _machine()
    return all(mine[k] and holder.get(k) == mine[k] for k in mine)


def _gone(holder: dict) -> bool:
    """Whether the holder's process is known to be gone: a pid on this machine that is no longer that process, or,
    on another machine, an earlier run of this SLURM job."""
    if _on_this_machine(holder) and isinstance(holder.get("pid"), int):
        start = _start_time(holder["pid"])
        return start is None or bool(start and holder.get("start") and start != holder["start"])
    job, restart = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_RESTART_COUNT", "0")
    return bool(holder.get("slurm_job")) and holder.get("slurm_job") == job and holder.get("slurm_restart") != restart


def _describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')} "
            f"(`{holder.get('command', '?')}`)")


def _remedy(holder: dict, path: Path) -> str:
    """What to do about a live ``holder`` of ``path``: on another machine it may be a job that is gone."""
    if _on_this_machine(holder):
        return "wait for it to end or stop it"
    return f"wait for it to end or stop it; if that job is gone, delete {path}"


def _create(path: Path, record: dict) -> bool:
    """Make ``path`` hold ``record`` unless it exists; whether it was made. The record is written whole under a name
    of this process's own and hard-linked to ``path`` (``link`` fails on an existing name, atomically, NFS too)."""
    # no other process shares the name: not one of the same host name and pid in another container either
    mine = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(8)}")
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


def _take_over(path: Path, stale: dict, what: str) -> tuple[Path, dict] | None:
    """Remove the stale hold ``path`` if it is still the one read as ``stale``; None when that is done (by this
    process or another), or the takeover marker and its live owner when another process is taking it over now.

    Only the process that creates the marker named after ``stale`` (``path.takeover-DIGEST.0``, by link: one
    process, atomically) may remove it, so the hold it reads under the marker is ``stale`` until it removes it, and
    no one else's fresh hold is ever removed. A marker whose owner is gone (killed while taking over) is passed by
    creating the next one (``.1``, ...), again one process only. The markers go once the stale hold is gone."""
    digest = hashlib.sha256(json.dumps(stale, sort_keys=True).encode()).hexdigest()[:16]
    markers = []
    while True:
        marker = path.with_name(f"{path.name}.takeover-{digest}.{len(markers)}")
        markers.append(marker)
        if _create(marker, _me()):
            break
        owner = _read(marker)
        if owner is None:  # removed: the stale hold is gone already
            return None
        if owner and not _gone(owner):
            return marker, owner
    if _read(path) == stale:
        path.unlink()
        fsync_dir(path.parent)
        print(f"mtp-train: {what}: taking over {path} from {_describe(stale)}, whose process is gone", file=sys.stderr)
    for marker in reversed(markers):  # the stale hold is gone for good: no marker of it guards anything now
        marker.unlink(missing_ok=True)
    return None


def _retry_pauses() -> Iterator[float]:
    pause = RETRY_FIRST_S
    while True:
        yield pause
        pause = min(2 * pause, RETRY_MAX_S)


def acquire(path: Path, what: str, timeout: float = 30.0, wait: float = 0.0) -> dict:
    """Take the hold ``path`` for ``what`` (a stage and the directory it writes) and return its record; a live
    holder is a one-line :class:`UserError` naming it, once ``wait`` seconds have passed. A stale hold being taken
    over, or one that vanishes between the link and the read, is tried again, with pauses, for ``timeout`` s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = _me()
    start = time.monotonic()
    pauses = _retry_pauses()
    while not _create(path, record):
        holder = _read(path)
        busy = None
        if holder is None:  # released between the two calls
            why = (f"{path} kept vanishing when read for {timeout:.0f} s (runs starting and stopping there?); "
                   f"try again once no other run writes {path.parent}")
        elif not holder:
            raise UserError(f"{what}: {path} is not a hold this tool wrote; delete it if no other run writes "
                            f"{path.parent}")
        elif not _gone(holder):
            if time.monotonic() - start < wait:
                time.sleep(next(pauses))
                continue
            raise UserError(f"{what}: {path.parent} is being written by {_describe(holder)}; {_remedy(holder, path)}")
        else:
            busy = _take_over(path, holder, what)
            why = f"could not take over the stale hold {path} in {timeout:.0f} s; delete it"
            if busy:
                marker, owner = busy
                why = (f"could not take over the stale hold {path} in {timeout:.0f} s: {_describe(owner)} is taking "
                       f"it over; if that process is gone, delete {marker}")
        if time.monotonic() - start > timeout:
            raise UserError(f"{what}: {why}")
        time.sleep(next(pauses))
    return record


def release(path: Path, record: dict) -> None:
    """Give the hold back, if it is still this process's."""
    if _read(path) == record:
        path.unlink(missing_ok=True)


def directory_lock(directory: Path) -> Path:
    """The shared hold of ``directory`` (its members' files are ``.lock.dir.TOKEN``)."""
    return directory / ".lock.dir"


def merge_lock(directory: Path) -> Path:
    """The lock of whoever writes or removes what every rank of ``directory`` makes together (the merged manifest)."""
    return directory / ".lock.merge"


def rank_lock(directory: Path, rank: int | None = None) -> Path:
    """The lock of one rank's writes in ``directory``: ``rank``, or this process's ``RANK`` (torchrun's), or 0."""
    return directory / f".lock.rank-{int(os.environ.get('RANK', '0')) if rank is None else rank:05d}"


def _made_for(path: Path) -> list[Path]:
    return [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # the folders the hold will make


def _remove_empty(made: list[Path]) -> None:
    for folder in made:  # a stage that failed before writing anything leaves no folder behind
        try:
            folder.rmdir()
        except OSError:  # not empty: the stage wrote something there
            break


@contextmanager
def exclusive(path: Path, what: str, index: int = 0, *, wait: float = 0.0, point: str | None = "hold"
              ) -> Iterator[None]:
    """Hold the lock ``path`` while the block runs (waiting up to ``wait`` s for a live holder to end); the folders
    made for it are removed after, where the block left them empty. The test hook's pause point ``POINT:<index>``
    (``hold`` unless told; none for None) comes right after the lock is taken, so that a test can start a second
    writer while the first holds it."""
    made = _made_for(path)
    record = acquire(path, what, wait=wait)
    try:
        if point:
            pause_point(point, index)
        yield
    finally:
        release(path, record)
        _remove_empty(made)


@contextmanager
def shared(path: Path, what: str, key: dict, label: str) -> Iterator[None]:
    """Hold ``path`` together with the processes of the same ``key`` while the block runs; a live member with
    another key (``label`` says what a key is, in words: "a precompute of world size 2 ...") is a one-line
    :class:`UserError` naming it. Each member adds its own file (``path.TOKEN``), then reads the others': of two
    that start at once, each sees the other. A member whose process is gone is removed (no one else has its name)."""
    made = _made_for(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**_me(), "key": key, "label": label}
    mine = path.with_name(f"{path.name}.{record['token']}")
    _create(mine, record)
    try:
        member = re.compile(re.escape(path.name) + r"\.[0-9a-f]{16}")
        for other in sorted(path.parent.iterdir()):
            if other == mine or not member.fullmatch(other.name):
                continue
            holder = _read(other)
            if holder is None:  # it left meanwhile
                continue
            if not holder:
                raise UserError(f"{what}: {other} is not a hold this tool wrote; delete it if no other run writes "
                                f"{path.parent}")
            if _gone(holder):
                other.unlink(missing_ok=True)
            elif holder.get("key") != key:
                raise UserError(f"{what}: {path.parent} is being written by {_describe(holder)}, "
                                f"{holder.get('label', 'another job')}, and this run is {label}: only the ranks of "
                                f"one job share a directory; {_remedy(holder, other)}, or give this run another "
                                "output directory")
    except BaseException:
        mine.unlink(missing_ok=True)
        _remove_empty(made)
        raise
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)
        _remove_empty(made)
