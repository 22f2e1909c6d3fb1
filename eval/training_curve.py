"""τ while each head trained (``train.tau_every``): the probes of the training logs, carried into the report.

A probe record of ``train_log.<kind>.jsonl`` (``mtp_train.eval.tau_probe``) holds the step, the training tokens so far,
τ and α₁ of the held-out prompts decoded greedily at the recipe's largest k, and, where the step also validated,
the held-out top-1 of the first draft step.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from mtp_train.recipe import Recipe


class TrainingPoint(BaseModel):
    """One τ probe of a head during its training."""

    model_config = ConfigDict(extra="forbid")

    step: int
    train_tokens: int
    tau: float
    alpha1: float
    val_top1: float | None = None


def training_curves(recipe: Recipe) -> dict[str, list[TrainingPoint]]:
    """Head kind -> its probes in step order, for every head the recipe trains whose log has any."""
    curves = {}
    for kind in recipe.head_kinds():
        log = recipe.output_dir / f"train_log.{kind}.jsonl"
        if not log.is_file():
            continue
        points = []
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill
                continue
            if isinstance(r, dict) and "tau" in r:
                top1 = r.get("val_top1")
                points.append(TrainingPoint(step=r["step"], train_tokens=r["train_tokens"], tau=r["tau"],
                                            alpha1=r["alpha1"], val_top1=top1[0] if top1 else None))
        if points:
            curves[kind] = points
    return curves
