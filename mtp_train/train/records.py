"""The run's records: one JSON line per optimizer step in the recipe's ``train_log`` (trimmed on resume to the steps
the checkpoint has seen) and, on rank 0, a wandb run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mtp_train.io import write_atomic
from mtp_train.recipe import Recipe


def trim_log(path: Path, step: int) -> None:
    """Keep the records of steps the resumed checkpoint has seen; a line torn by a kill is dropped."""
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept).encode())


def logged_tokens(path: Path, step: int) -> int:
    """The training tokens of every step up to ``step`` in the log at ``path`` (0 without a log)."""
    if not path.exists():
        return 0
    records = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return sum(r.get("tokens", 0) for r in records if r.get("step", 0) <= step)


def append_record(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def start_wandb(recipe: Recipe, main: bool) -> Any:
    """A wandb run on rank 0 (``WANDB_MODE`` overrides ``train.wandb_mode``), else None."""
    mode = os.environ.get("WANDB_MODE", recipe.train.wandb_mode)
    if not main or mode == "disabled":
        return None
    import wandb

    return wandb.init(project=recipe.train.wandb_project, mode=mode, dir=str(recipe.output_dir),
                      config=recipe.model_dump(mode="json"), name=f"{recipe.output_dir.name}-{recipe.head.kind}")
