"""Why acceptance is what it is: an implementation mismatch, a distribution shift, or neither.

The runtime's validation re-scores the held-out training sequences with the runtime's target and head. When
it disagrees with the trainer's validation, the two implementations differ (a bug). When it agrees, the head
predicts the training distribution as well in the runtime as in the trainer; if its first-position acceptance
α₁ in decoding is then far below its validation top-1, the prompts and the target's own answers are not what it
was trained on: a distribution shift, which training on the target's own answers (``data.regenerate``) cures.

α₁ at T = 0 and the validation top-1 of unrolled step 1 measure the same event, the draft's argmax equal to the
target's, on two distributions; so their gap is the shift, up to sampling noise on few prompts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

SHIFT_GAP = 0.1
"""Validation top-1 minus α₁ above which a consistent head is diagnosed as trained on another distribution."""

Verdict = Literal["consistent", "distribution_shift", "implementation_mismatch", "not_applicable"]


class SliceCheck(BaseModel):
    """α₁ in decoding on one slice of the prompts (a category or a prompt set) against the validation top-1."""

    model_config = ConfigDict(extra="forbid")

    name: str
    num_prompts: int
    alpha1: float
    val_top1: float
    gap: float  # val_top1 - alpha1


class Diagnosis(BaseModel):
    """The report's verdict on acceptance, with the numbers it rests on (T = the sweep's lowest, smallest k)."""

    model_config = ConfigDict(extra="forbid")

    verdict: Verdict
    message: str
    alpha1: float | None = None
    val_top1: float | None = None
    threshold: float = SHIFT_GAP
    by_category: list[SliceCheck] = []
    by_prompt_set: list[SliceCheck] = []


def _slices(groups: dict, val_top1: float) -> list[SliceCheck]:
    return [SliceCheck(name=name, num_prompts=g.num_prompts, alpha1=g.alpha[0], val_top1=val_top1,
                       gap=round(val_top1 - g.alpha[0], 4))
            for name, g in sorted(groups.items()) if g.alpha]


def diagnose(point, val_top1: list[float], val_mismatch: bool) -> Diagnosis:
    """The verdict for sweep point ``point`` (a ``SweepPoint``), given the runtime's validation top-1 per
    unrolled step and whether it disagreed with the trainer's."""
    if val_mismatch:
        return Diagnosis(verdict="implementation_mismatch", message=(
            "IMPLEMENTATION MISMATCH: the runtime's validation differs from the trainer's on the same held-out "
            "sequences, so the runtime does not run the head (or the target) the way the trainer does. Acceptance "
            "numbers are not meaningful until this is fixed."))
    if not val_top1 or not point.alpha:
        return Diagnosis(verdict="not_applicable", message=(
            "No runtime validation to compare with (a draft model, or no held-out features): acceptance is "
            "reported as measured."))
    top1, a1 = val_top1[0], point.alpha[0]
    cats, sets = _slices(point.by_category, top1), _slices(point.by_prompt_set, top1)
    numbers = dict(alpha1=a1, val_top1=top1, by_category=cats, by_prompt_set=sets)
    if top1 - a1 > SHIFT_GAP:
        return Diagnosis(verdict="distribution_shift", message=(
            f"DISTRIBUTION SHIFT: the runtime's validation agrees with the trainer's (top-1 {top1:.3f} on held-out "
            f"training sequences), but α₁ in decoding is {a1:.3f}, {top1 - a1:.3f} below it. The implementation is "
            "consistent; the head was trained on a different distribution than the target generates on these "
            "prompts. Train on the target's own answers (data.regenerate: true), on prompts like these "
            "(a general prompt set for general use)."), **numbers)
    return Diagnosis(verdict="consistent", message=(
        f"Consistent: α₁ in decoding ({a1:.3f}) is within {SHIFT_GAP:g} of the validation top-1 ({top1:.3f}), and "
        "the runtime's validation agrees with the trainer's."), **numbers)


def diagnosis_blocks(d: Diagnosis) -> list[tuple]:
    """The report section's blocks (the renderers' ``("p"|"flag"|"table", ...)`` tuples)."""
    blocks: list[tuple] = [("flag" if d.verdict in ("distribution_shift", "implementation_mismatch") else "p",
                            d.message)]
    for title, rows in (("prompt set", d.by_prompt_set), ("category", d.by_category)):
        if rows:
            blocks.append(("table", [title, "prompts", "α₁ in decoding", "validation top-1", "gap"],
                           [[s.name, str(s.num_prompts), f"{s.alpha1:.3f}", f"{s.val_top1:.3f}", f"{s.gap:+.3f}"]
                            for s in rows]))
    return blocks
