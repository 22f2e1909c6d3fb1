"""The eval's report assembled from its sweep, its validation and the context (versions, device)."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from mtp_train.eval.diagnosis import diagnose
from mtp_train.eval.report import Report, SweepPoint
from mtp_train.recipe import Recipe
from mtp_train.runtime.machine import describe


@dataclass(frozen=True)
class EvalContext:
    """What the report states beside the sweep: the draft's mode, the eval's fingerprint, the prompts decoded and
    those skipped as too long, the lossless verdict over every T = 0 sweep point (``lossless_detail``: why it
    failed) and the validation numbers, the runtime's and the trainer's (``None`` without a trained head)."""

    mode: str
    fingerprint: str
    num_prompts: int
    skipped: int
    lossless: bool | None
    lossless_detail: str | None
    validation: dict | None


def assemble_report(recipe: Recipe, sweep: list[SweepPoint], context: EvalContext) -> Report:
    """The report of the eval's sweep: the headline is the lowest-temperature chain with the highest measured
    speedup (expected, where none was measured); the diagnosis reads the lowest-temperature point with the smallest
    k."""
    coolest = min(p.temperature for p in sweep)
    head = max((p for p in sweep if p.temperature == coolest),
               key=lambda p: p.expected_speedup if p.measured_speedup is None else p.measured_speedup)
    first = min((p for p in sweep if p.temperature == coolest), key=lambda p: p.k)
    tol = recipe.eval.val_tolerance
    val = _validation_fields(context.validation, tol)
    return Report(
        diagnosis=diagnose(first, val["val_acc"], val["val_mismatch"]), by_prompt_set=head.by_prompt_set,
        tau=head.tau, alpha=head.alpha, alpha_unconditional=head.alpha_unconditional, k=head.k,
        temperature=head.temperature, lossless=context.lossless, lossless_detail=context.lossless_detail,
        draft_cost_ratio=head.draft_cost_ratio, verify_cost_ratio=head.verify_cost_ratio,
        expected_speedup=head.expected_speedup,
        measured_speedup=head.measured_speedup, distinct2=head.distinct2, by_category=head.by_category,
        by_length=head.by_length, **val, val_tolerance=tol, sweep=sweep, mode=context.mode,
        settings=_settings(recipe, context),
        versions=_versions(), device=describe(), created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _validation_fields(validation: dict | None, tol: float) -> dict[str, Any]:
    """The report's validation fields: the runtime's loss and accuracy per unrolled step, the trainer's, and
    whether the two differ beyond ``tol`` (relative for the loss, absolute for the accuracy)."""
    val_loss, val_acc, trainer_loss, trainer_acc, mismatch = [], [], None, None, False
    if validation:
        ours, theirs = validation["runtime"], validation["trainer"]
        val_loss = [x for x in ours["val_loss"] if x is not None]
        val_acc = ours["val_top1"]
        trainer_loss, trainer_acc = theirs.get("val_loss"), theirs.get("val_top1")
        if trainer_loss and trainer_acc:
            mismatch = any(abs(a - b) > tol * abs(b) for a, b in zip(val_loss, trainer_loss) if b is not None) or any(
                abs(a - b) > tol for a, b in zip(val_acc, trainer_acc))
    return {"val_loss": val_loss, "val_acc": val_acc, "trainer_val_loss": trainer_loss,
            "trainer_val_acc": trainer_acc, "val_mismatch": mismatch}


def _settings(recipe: Recipe, context: EvalContext) -> dict[str, Any]:
    """What the report was made with: the eval's fingerprint, target, draft and settings, the prompts."""
    return {"fingerprint": context.fingerprint, "target": str(recipe.target.path), "dtype": recipe.target.dtype,
            "draft": str(recipe.eval.draft_model) if recipe.eval.draft_model else f"{context.mode} head",
            "eval": recipe.eval.model_dump(mode="json"), "seed": recipe.seed, "num_prompts": context.num_prompts,
            "prompts_skipped_too_long": context.skipped,
            "tau_convention": "tokens emitted per target verification step, bonus token included",
            "headline": "lowest temperature, highest measured speedup (chains)"}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("mtp-train", "torch", "transformers", "safetensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
