"""The rows of an online plan (``precompute.mode: online``), read from the recipe's data only when a shard that holds
them is scored: each training rank converts and tokenizes the rows of its own windows (and the held-out rows it
validates on), never the whole dataset.

The data files are opened once (``datasets`` maps them; no row is converted) and read by global row id. Where
precompute regenerated the answers, each worker's answer file is indexed once (the byte range of each row's line;
only its row id is parsed) and a row's answer is parsed when the row is asked for. ``ShardEncoder`` encodes the
shards a later step will score on a thread of its own, so that the training step's path only scores.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtp_train.data.answers import regenerated_path, regeneration_key
from mtp_train.data.dataset import LoadedData, _add_row, _load_file, encode_many
from mtp_train.data.formats import Messages, detect_format
from mtp_train.data.tokenizer import load_tokenizer
from mtp_train.errors import UserError
from mtp_train.features.manifest import Manifest, data_fingerprint, text_fingerprint, tokenizer_fingerprint
from mtp_train.recipe import Recipe
from mtp_train.threads import leave_signals_to_main_thread

_ROW_ID = re.compile(rb'\{"row_id": (\d+),')  # how AnswerFile.append starts each line


class DataRows:
    """The recipe's data files, opened and read by global row id (the rows' ids as ``load_rows`` numbers them)."""

    def __init__(self, files: list[Path], fmt: str, skip_bad_rows: bool, max_rows: int | None) -> None:
        self.skip_bad_rows = skip_bad_rows
        self.files: list[tuple[Path, object, int, str]] = []  # path, its dataset, its first row id, its format
        first = 0
        for path in files:
            if max_rows is not None and first >= max_rows:
                break
            if not path.exists():
                raise UserError(f"data.train: {path} not found")
            ds = _load_file(path)  # the loader precompute used, so that rows and their ids are the same
            file_fmt = fmt if fmt != "auto" else detect_format(list(ds.column_names))
            if file_fmt is None:
                raise UserError(f"{path}: cannot detect the row format from columns {ds.column_names}; set data.format")
            self.files.append((path, ds, first, file_fmt))
            first += len(ds)

    def contents(self, row_ids: list[int]) -> dict[int, Messages | str]:
        """Each row's messages (or text), converted now; a row that no longer converts is refused (the data
        changed since the plan was made)."""
        wanted = np.asarray(row_ids, np.int64)
        out = LoadedData(rows=[])
        for path, ds, first, fmt in self.files:
            local = wanted[(wanted >= first) & (wanted < first + len(ds))] - first
            for i, raw in zip(local.tolist(), ds.select(local.tolist())):
                _add_row(out, path, i, first + i, raw, fmt, self.skip_bad_rows)
        got = {r.row_id: r.content for r in out.rows}
        if len(got) != len(set(row_ids)):
            missing = sorted(set(row_ids) - set(got))[:1]
            raise UserError(f"data.train: row {missing} of the online plan is gone or no longer reads; rerun "
                            "`mtp-train precompute` with --overwrite")
        return got


class AnswerRows:
    """The regenerated answers of an online plan's workers, by row id: each worker's answer file indexed once (the
    byte range of each complete line with the plan's key), each answer parsed when asked for."""

    def __init__(self, features: Path, ranks: list[int], key: str) -> None:
        self.where: dict[int, tuple[Path, int, int]] = {}  # row id -> file, first byte, line length
        for rank in ranks:
            path = regenerated_path(features, rank)
            if path.is_file():
                self._index(path, key)

    def _index(self, path: Path, key: str) -> None:
        with open(path, "rb") as f:
            header = f.readline()
            try:
                if json.loads(header).get("fingerprint") != key:
                    return  # answers to other settings: not this plan's
            except (json.JSONDecodeError, AttributeError):
                return
            at = len(header)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a torn last line: that row was not regenerated
                m = _ROW_ID.match(line)
                row = int(m.group(1)) if m else int(json.loads(line)["row_id"])
                self.where[row] = (path, at, len(line))
                at += len(line)

    def answers(self, row_ids: list[int]) -> dict[int, Messages]:
        """The answered rows among ``row_ids``, as messages."""
        out = {}
        for row in row_ids:
            if row in self.where:
                path, at, n = self.where[row]
                with open(path, "rb") as f:
                    f.seek(at)
                    out[row] = json.loads(f.read(n))["messages"]
        return out


class PlannedRows:
    """The rows of an online plan, rebuilt from the recipe's data as precompute read them (with the target's answers
    where it regenerated them), converted and encoded on request; refused when the data, tokenizer or chat template
    are no longer those the plan was made from."""

    def __init__(self, recipe: Recipe, manifest: Manifest, root: Path) -> None:
        s, fingerprint = manifest.settings, manifest.fingerprint
        self.tokenizer = load_tokenizer(recipe)
        now = {"tokenizer": tokenizer_fingerprint(recipe.target.path),
               "chat template": text_fingerprint(str(self.tokenizer.chat_template)),
               "data files": data_fingerprint(recipe.data.train)}
        changed = [what for (what, v), key in zip(now.items(), ("tokenizer", "chat_template", "data"))
                   if fingerprint.get(key) != v]
        if changed:
            raise UserError(f"{root}: the plan was made from other {' and '.join(changed)} than the recipe names now; "
                            "rerun `mtp-train precompute` with --overwrite")
        self.data = DataRows(recipe.data.train, s["format"], s["skip_bad_rows"], s["max_rows"])
        self.answered = None
        if manifest.regenerated:
            key = regeneration_key(fingerprint, manifest.sampling or {}, s["max_length"])
            self.answered = AnswerRows(root, manifest.ranks, key)
        self.max_length = s["max_length"]
        self.root = root
        self._lock = threading.Lock()  # one encoding at a time: a fast tokenizer is not to be shared by threads

    def contents(self, row_ids: list[int]) -> dict[int, Messages | str]:
        """Each row as precompute encoded it: its regenerated answers where there are some, else the data's."""
        content = self.data.contents(row_ids)
        if self.answered is not None:
            content.update(self.answered.answers(row_ids))
        return content

    def encode(self, row_ids: list[int]) -> list[tuple[list[int], list[int]]]:
        """Token ids and loss mask of each row, as precompute encoded them."""
        with self._lock:
            content = self.contents(row_ids)
            encoded = encode_many(self.tokenizer, [content[i] for i in row_ids], self.max_length, row_ids)
        return [(ids, mask) for ids, mask, _ in encoded]

    def encode_checked(self, row_ids: list[int], lengths: np.ndarray, what: str) -> EncodedRows:
        """``encode`` of rows the plan records with ``lengths [S]`` tokens, refused (naming ``what``) when they
        encode to other lengths."""
        rows = self.encode(row_ids)
        if [len(ids) for ids, _ in rows] != np.atleast_1d(lengths).tolist():
            raise UserError(f"{self.root}: {what} encode to other lengths than the plan records (the data, its "
                            "regenerated answers or the encoding changed); rerun `mtp-train precompute` with "
                            "--overwrite")
        return EncodedRows(np.asarray([t for ids, _ in rows for t in ids], np.int32),
                           np.asarray([m for _, mask in rows for m in mask], np.uint8),
                           np.asarray([len(ids) for ids, _ in rows], np.int64))


@dataclass(frozen=True)
class EncodedRows:
    """Sequences of ``lengths [S]`` tokens, back to back: token ids ``ids [T]`` int32 and loss mask ``mask [T]``
    uint8 (a shard's ``input_ids`` and ``loss_mask``)."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray

    def sequences(self) -> list[list[int]]:
        """Each sequence's token ids (what ``Engine.score`` takes)."""
        return [part.tolist() for part in np.split(self.ids, np.cumsum(self.lengths)[:-1])]

    def arrays(self) -> dict[str, np.ndarray]:
        """``input_ids`` and ``loss_mask`` as their bytes (uint8)."""
        return {"input_ids": self.ids.view(np.uint8), "loss_mask": self.mask}


class ShardEncoder:
    """Encodes shards' rows (``encode(name)``) on one thread of its own, ahead of the step that scores them:
    ``prepare(names)`` asks for them, ``take(name)`` gives a shard's rows (waiting for its encoding in progress, or
    encoding it now when it was not asked for). The thread is a daemon: a run that stops (a signal, the end) does
    not wait for the windows it asked for."""

    def __init__(self, encode: Callable[[str], EncodedRows]) -> None:
        self._encode = encode
        self._jobs: queue.Queue[tuple[str, Future[EncodedRows]] | None] | None = None
        self._thread: threading.Thread | None = None
        self._prepared: dict[str, Future[EncodedRows]] = {}

    def prepare(self, names: Iterable[str]) -> None:
        """Encode ``names`` in that order on the thread; what an earlier call asked for and this one does not name
        is dropped (a window that will not be scored soon)."""
        want = list(dict.fromkeys(names))
        for name in [n for n in self._prepared if n not in want]:
            self._prepared.pop(name).cancel()
        if want and self._thread is None:
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), name="shard-encode", daemon=True)
            self._thread.start()
        for name in want:
            if name not in self._prepared:
                self._prepared[name] = future = Future()
                self._jobs.put((name, future))

    def take(self, name: str, keep: bool = False) -> EncodedRows:
        """Shard ``name``'s rows; ``keep``: leave them prepared for a later ``take``."""
        future = self._prepared.get(name) if keep else self._prepared.pop(name, None)
        return future.result() if future is not None else self._encode(name)

    def close(self) -> None:
        """Stop the thread (an encoding in progress finishes first) and forget what was prepared."""
        for future in self._prepared.values():
            future.cancel()
        self._prepared.clear()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = self._jobs = None

    def _run(self, jobs: queue.Queue) -> None:
        leave_signals_to_main_thread()
        while (job := jobs.get()) is not None:
            name, future = job
            if future.set_running_or_notify_cancel():  # False: dropped before its turn
                try:
                    future.set_result(self._encode(name))
                except BaseException as e:  # raised where the rows are taken (a changed row: a UserError)
                    future.set_exception(e)
