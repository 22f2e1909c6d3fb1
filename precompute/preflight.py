"""The data checks of precompute that need the tokenizer only: the data files exist, the chat template renders the
chat rows, and their loss masks hold tokens.

Precompute runs them over every row of its block; ``--dry-run`` and ``mtp-train slurm`` over the first rows
(``check_first_rows``), so that a template the run would refuse is refused before any weight is loaded or any job
is queued. They also size the features from those rows, and refuse a filesystem that cannot hold them.
"""

from __future__ import annotations

import bisect
import itertools
import math

from mtp_train.errors import UserError
from mtp_train.features.layers import stored_layers
from mtp_train.features.space import DiskPlan, bytes_per_token
from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.data.chat_mask import require_template
from mtp_train.data.dataset import LoadedData, Row, count_rows, encode_many, load_rows
from mtp_train.data.tokenizer import load_tokenizer

FIRST_ROWS = 8  # the rows the checks read
SAMPLE_ROWS = 64  # the rows whose mean length sizes the features


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


def check_first_rows(recipe: Recipe, tasks: int = 1) -> DiskPlan:
    """Precompute's checks over the first ``FIRST_ROWS`` rows of the data, with the recipe's tokenizer (no weights),
    and the features' disk plan over ``tasks`` array tasks: the data's rows times the mean tokens of its first
    ``SAMPLE_ROWS`` rows, encoded as precompute encodes them (truncated at ``data.max_length``)."""
    check_data_files(recipe)
    tokenizer = load_tokenizer(recipe)
    d = recipe.data
    sample = load_rows(d.train, d.format, d.skip_bad_rows, min(SAMPLE_ROWS, d.max_rows or SAMPLE_ROWS))
    check_rows(sample, tokenizer, str(recipe.target.path))
    encoded = encode_many(tokenizer, [r.content for r in sample.rows], d.max_length, [r.row_id for r in sample.rows])
    first = sample.rows[:FIRST_ROWS]
    mask_counts(sample, first, encoded[:FIRST_ROWS], f"each of the first {len(first)} rows")
    rows = min(count_rows(d.train), d.max_rows or math.inf)
    mean = sum(len(ids) for ids, _, _ in encoded) / len(encoded)
    cfg = ModelConfig.from_hf(find_checkpoint(recipe.target.path).config, str(recipe.target.path / "config.json"))
    how = (f"{rows:,} rows x {mean:,.0f}, the mean of the first {len(encoded)}"
           + (", before regeneration replaces their answers" if d.regenerate else ""))
    p = recipe.precompute
    per_token = {dtype: bytes_per_token(len(stored_layers(recipe, cfg)), cfg.hidden_size, p.topk, dtype)
                 for dtype in ("bf16", "fp8")}
    stored = "online" if p.mode == "online" else p.hidden_dtype
    return DiskPlan(recipe.features_dir, round(rows * mean), per_token, stored, tasks, how,
                    (max(len(ids) for ids, _, _ in encoded), d.max_length))
