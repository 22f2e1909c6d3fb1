"""Regenerated answers (``data.regenerate``), kept as a dataset file, ``FEATURES/regenerated.rank-RRRRR.jsonl``: a header line
``{"fingerprint": ...}`` (target, tokenizer, chat template, data files, sampling with its seed, and
``data.max_length``; not ``max_rows``, so a run over more rows reuses the answers it has), then one line per
regenerated row, ``{"row_id": N, "messages": [...]}`` (the ``openai`` row format), appended and fsync'd as
rows finish (every ``save_rows`` rows, or sooner once ``save_seconds`` have passed, so a kill among long rows
loses at most that much generation). A rerun keeps the rows the file already holds (a torn last line from a
kill is cut off) and generates only the rest; a file with another fingerprint is started afresh. The file
survives ``precompute --overwrite``, so changing what is stored (layers, top-K) does not regenerate.

Precompute writes the file (``mtp_train.precompute.regenerate``); online training reads every rank's file back to
rebuild the rows its plan holds (``mtp_train.features.online``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_train.data.dataset import Row


SAVE_ROWS = 64
SAVE_SECONDS = 120.0


def regenerated_path(features: Path, rank: int) -> Path:
    return features / f"regenerated.rank-{rank:05d}.jsonl"


def _read_done(path: Path, fingerprint: str, write: bool) -> dict[int, list[dict[str, str]]]:
    """Rows the file already holds; a torn last line is cut off, a file of another fingerprint is removed (both
    only when ``write``)."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    lines = data.split(b"\n")
    good = len(data) if data.endswith(b"\n") else len(data) - len(lines[-1])
    done: dict[int, list[dict[str, str]]] = {}
    try:
        header = json.loads(lines[0]) if lines[0] else {}
    except json.JSONDecodeError:
        header = {}
    if header.get("fingerprint") != fingerprint:
        if write:
            path.unlink()
        return {}
    for line in lines[1:]:
        if line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # only the torn last line can be partial; good stops before it
                break
            done[int(rec["row_id"])] = rec["messages"]
    if good < len(data) and write:
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _append(path: Path, lines: list[str], header: str | None) -> None:
    with open(path, "a", encoding="utf-8") as f:
        if header is not None:
            f.write(header + "\n")
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class AnswerFile:
    """Where ``regenerate`` keeps its answers to reuse them (module docstring): ``path``, reused only when its header
    carries ``fingerprint``; finished rows are appended ``save_rows`` at a time, or when ``save_seconds`` have
    passed since the last append. Under tensor parallelism every rank reads it, and only the leader (``write``)
    writes it and prints."""

    path: Path
    fingerprint: str
    save_rows: int = SAVE_ROWS
    save_seconds: float = SAVE_SECONDS
    write: bool = True

    def read(self) -> dict[int, list[dict[str, str]]]:
        return _read_done(self.path, self.fingerprint, self.write)

    def append(self, rows: list[Row]) -> None:
        header = json.dumps({"fingerprint": self.fingerprint}) if not self.path.is_file() else None
        _append(self.path, [json.dumps({"row_id": r.row_id, "messages": r.content}) for r in rows], header)




def regeneration_key(fingerprint: dict[str, str], sampling: dict[str, Any], max_length: int) -> str:
    """The fingerprint an answer file is reused under: the features' target, tokenizer, chat template and data
    fingerprints, the sampling settings (with the seed) and ``data.max_length``."""
    source = {k: fingerprint[k] for k in ("target", "tokenizer", "chat_template", "data")}
    text = json.dumps({**source, "sampling": sampling, "max_length": max_length}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_answers(features: Path, ranks: list[int], key: str) -> dict[int, list[dict[str, str]]]:
    """Every regenerated row of ``ranks``' answer files that carry ``key``, by row id (read only)."""
    answers: dict[int, list[dict[str, str]]] = {}
    for rank in ranks:
        answers.update(AnswerFile(regenerated_path(features, rank), key, write=False).read())
    return answers
