"""Read the recipe's data files through ``datasets`` and turn rows into token ids with a loss mask."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.data.chat_mask import chat_masks
from mtp_train.data.formats import BadRow, Messages, detect_format, to_messages


@dataclass
class Row:
    """One dataset row: a global id (position across all data files in order) and its content."""

    row_id: int
    content: Messages | str


@dataclass
class LoadedData:
    rows: list[Row]  # the rows asked for (all, or one worker's block), bad ones left out
    num_rows: int = 0  # rows of the whole data (good or bad, up to ``max_rows``), not only those loaded
    file_rows: dict[str, int] = field(default_factory=dict)  # file -> rows it holds
    formats: dict[str, str] = field(default_factory=dict)  # file -> detected/declared format
    bad_rows: list[tuple[str, int, str]] = field(default_factory=list)  # (file, index in file, why)


def _load_file(path: Path):
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise UserError(f"{path}: saved DatasetDict has no 'train' split (has {sorted(ds)})")
                ds = ds["train"]
            return ds
        name = path.name.lower()
        if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            return datasets.load_dataset("json", data_files=str(path), split="train")
        if name.endswith(".parquet"):
            return datasets.load_dataset("parquet", data_files=str(path), split="train")
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for malformed input
        raise UserError(f"{path}: cannot be read as a dataset: {str(e).splitlines()[0][:200]}") from None
    raise UserError(f"{path}: unsupported data file; use JSONL, JSON, Parquet or a saved HF dataset directory")


def load_rows(files: list[Path], fmt: str, skip_bad_rows: bool, max_rows: int | None,
              part: tuple[int, int] = (0, 1)) -> LoadedData:
    """The rows of ``files`` in order, as messages or text; bad rows are an error unless skipped.

    ``part`` = (rank, world): only the contiguous block of row ids that rank owns (:func:`rank_block`) is read and
    converted; every file is opened (for its length), no other row is touched.
    """
    out = LoadedData(rows=[])
    loaded = []
    for path in files:
        if not path.exists():
            raise UserError(f"data.train: {path} not found")
        ds = _load_file(path)
        loaded.append((path, ds))
        out.file_rows[str(path)] = len(ds)
        out.num_rows += len(ds)
        if max_rows is not None and out.num_rows >= max_rows:
            out.num_rows = max_rows
            break
    lo, hi = rank_block(out.num_rows, *part)
    next_id = 0
    for path, ds in loaded:
        file_fmt = fmt if fmt != "auto" else detect_format(list(ds.column_names))
        if file_fmt is None:
            raise UserError(
                f"{path}: cannot detect the row format from columns {ds.column_names}; "
                "set data.format (sharegpt, openai, prompt_completion or text)"
            )
        out.formats[str(path)] = file_fmt
        first, last = max(lo - next_id, 0), min(hi - next_id, len(ds))
        if first < last:
            for i, raw in enumerate(ds.select(range(first, last)), start=first):
                _add_row(out, path, i, next_id + i, raw, file_fmt, skip_bad_rows)
        next_id += len(ds)
    return out


def _add_row(out: LoadedData, path: Path, i: int, row_id: int, raw: dict, fmt: str, skip_bad_rows: bool) -> None:
    """Row ``i`` of file ``path`` converted into ``out.rows``, or recorded as bad (an error unless skipped)."""
    try:
        out.rows.append(Row(row_id, to_messages(raw, fmt)))
    except BadRow as e:
        if not skip_bad_rows:
            raise UserError(
                f"{path}: row {i} does not fit format {fmt!r} ({e}); fix it or set data.skip_bad_rows: true"
            ) from None
        out.bad_rows.append((str(path), i, str(e)))


def rank_block(num_rows: int, rank: int, world: int) -> tuple[int, int]:
    """The row ids ``[lo, hi)`` that rank ``rank`` of ``world`` owns: a contiguous block, in order."""
    return rank * num_rows // world, (rank + 1) * num_rows // world


def count_rows(files: list[Path]) -> int:
    """How many rows ``files`` hold, good or bad (a missing file is an error)."""
    for path in files:
        if not path.exists():
            raise UserError(f"data.train: {path} not found")
    return sum(len(_load_file(path)) for path in files)


def heldout_ids(num_rows: int, count: int, seed: int) -> set[int]:
    """The seeded draw of rows that training never sees (the eval's held-out prompts)."""
    return set(random.Random(seed).sample(range(num_rows), min(count, num_rows)))


def encode(tokenizer: Any, content: Messages | str, max_length: int) -> tuple[list[int], list[int], bool]:
    """Token ids, loss mask (1 on assistant tokens; every token but the first for text) and whether it was cut."""
    return encode_many(tokenizer, [content], max_length)[0]


def encode_many(
    tokenizer: Any, contents: list[Messages | str], max_length: int, row_ids: list[int] | None = None,
    chunk: int = 256,
) -> list[tuple[list[int], list[int], bool]]:
    """``encode`` for many rows; chat rows are masked a chunk at a time (``mtp_train.data.chat_mask``).

    ``row_ids`` name the rows in error messages (default: their positions in ``contents``).
    """
    ids_of = row_ids if row_ids is not None else list(range(len(contents)))
    out: list[tuple[list[int], list[int]] | None] = [None] * len(contents)
    chats = [i for i, c in enumerate(contents) if not isinstance(c, str)]
    if chats:
        masked = chat_masks(tokenizer, [contents[i] for i in chats], [ids_of[i] for i in chats], chunk)
        for i, enc in zip(chats, masked):
            out[i] = enc
    for i, c in enumerate(contents):
        if isinstance(c, str):
            ids = tokenizer(c, add_special_tokens=True)["input_ids"]
            out[i] = (ids, [0] + [1] * (len(ids) - 1))
    return [(ids[:max_length], mask[:max_length], len(ids) > max_length) for ids, mask in out]
