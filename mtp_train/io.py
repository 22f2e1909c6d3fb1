"""Atomic writes, the crash and pause hooks that test them, and token-budget groups: shared by every stage.

A file is written to a hidden temp file in the same directory (``.NAME.HOST.PID.tmp``), fsync'd, renamed over
``NAME``, and then the directory is fsync'd; a failure removes the temp file. A directory is filled
under a temp name, fsync'd and renamed the same way. A crash leaves the old version or the new one,
never a mix. This module imports nothing else of the project, so any part may import it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

CRASH_ENV = "MTP_TRAIN_CRASH_AT"  # test hook: "point:index" kills the process there with SIGKILL
PAUSE_ENV = "MTP_TRAIN_PAUSE_AT"  # test hook: "point:index" stops the process there with SIGSTOP
PAUSE_DIR_ENV = "MTP_TRAIN_PAUSE_DIR"  # where a pausing process first leaves a file named by its pid


def crash_point(point: str, index: int) -> None:
    """Die like a killed job at ``point`` for ``index`` (a shard, a step) when the test hook asks for it."""
    if os.environ.get(CRASH_ENV) == f"{point}:{index}":
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(point: str, index: int) -> None:
    """Stop (SIGSTOP) at ``point`` for ``index`` when the test hook asks for it, after leaving a file named by this
    process's pid in the hook's directory, if one is named: a test then acts on a process that cannot move on
    (damages its inputs, signals it) and continues it with SIGCONT, with no race against its progress."""
    if os.environ.get(PAUSE_ENV) != f"{point}:{index}":
        return
    if directory := os.environ.get(PAUSE_DIR_ENV):
        write_atomic(Path(directory) / str(os.getpid()), b"")
    os.kill(os.getpid(), signal.SIGSTOP)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, payload: bytes | str, *, mode: int | None = None, crash_index: int | None = None) -> None:
    """Replace ``path`` with ``payload`` (str is written as UTF-8); ``mode`` sets its permissions.

    With ``crash_index``, the hook's point ``write:<crash_index>`` fires halfway through the payload.
    """
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # two writers never share it
    try:
        with open(tmp, "wb") as f:
            if crash_index is None:
                f.write(data)
            else:
                half = len(data) // 2
                f.write(data[:half])
                crash_point("write", crash_index)
                f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` as indented JSON."""
    write_atomic(path, json.dumps(data, indent=1))


def fresh_dir(path: Path) -> Path:
    """An empty directory at ``path`` (what a crashed run left there is removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the filled directory ``tmp`` in place of ``final``, removing an old ``final`` first."""
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def group_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Cut indices, in order, into groups of at most ``budget`` tokens (a longer item gets a group of its own)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if current and total + n > budget:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        groups.append(current)
    return groups
