"""The data checks of precompute that need the tokenizer only: the data files exist, the chat template renders the
chat rows, and their loss masks hold tokens.

Precompute runs them over every row of its block; ``--dry-run`` over the first rows (``check_first_rows``), so that
a template the run would refuse is refused before any weight is loaded or any job is queued.
"""

from __future__ import annotations

import bisect
import itertools

from mtp_train.errors import UserError
from mtp_train.recipe import Recipe
from mtp_train.data.chat_mask import require_template
from mtp_train.data.dataset import LoadedData, Row, encode_many, load_rows
from mtp_train.data.tokenizer import load_tokenizer

FIRST_ROWS = 8


def check_data_files(recipe: Recipe) -> None:
    for path in recipe.data.train:
        if not path.exists():
            raise UserError(f"data.train: {path} not found")


def check_rows(data: LoadedData, tokenizer, source: str) -> None:
    """Some rows, and a chat template when any of them is a chat."""
    if not data.rows:
        raise UserError("data.train: no usable rows")
    if any(not isinstance(r.content, str) for r in data.rows):
        require_template(tokenizer, source)


def mask_counts(data: LoadedData, rows: list[Row], encoded: list[tuple[list[int], list[int], bool]],
                which: str = "every row") -> dict[str, list[int]]:
    """``[tokens masked in, tokens]`` per data file, over ``rows`` (``which`` of the file's rows, in the error);
    a file with none masked in is refused."""
    bounds = list(itertools.accumulate(data.file_rows.values()))
    files = list(data.file_rows)
    counts: dict[str, list[int]] = {}
    for row, (ids, mask, _) in zip(rows, encoded):
        c = counts.setdefault(files[bisect.bisect_right(bounds, row.row_id)], [0, 0])
        c[0] += sum(mask)
        c[1] += len(ids)
    for path, (masked, _) in counts.items():
        if masked == 0:
            raise UserError(f"{path}: the chat template gave an empty loss mask for {which} of this file; nothing "
                            "to train on (check its assistant turns, or set data.chat_template)")
    return counts


def check_first_rows(recipe: Recipe, count: int = FIRST_ROWS) -> None:
    """Precompute's checks over the first ``count`` rows of the data, with the recipe's tokenizer (no weights)."""
    check_data_files(recipe)
    tokenizer = load_tokenizer(recipe)
    d = recipe.data
    data = load_rows(d.train, d.format, d.skip_bad_rows, min(count, d.max_rows or count))
    check_rows(data, tokenizer, str(recipe.target.path))
    encoded = encode_many(tokenizer, [r.content for r in data.rows], d.max_length, [r.row_id for r in data.rows])
    mask_counts(data, data.rows, encoded, f"each of the first {len(data.rows)} rows")
