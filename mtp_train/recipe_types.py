"""What every recipe section shares: the strict base model, paths resolved against the recipe's directory, and the
names of the prompt sets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo


def _resolve(path: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base_dir")
    if base is not None and not path.is_absolute():
        return (Path(base) / path).resolve()
    return path


RecipePath = Annotated[Path, AfterValidator(_resolve)]
PROMPT_SETS = ("heldout", "spec_bench", "mt_bench", "humaneval", "gsm8k", "sgd_dev", "long")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)
