"""The report tells a distribution shift from an implementation mismatch (eval/diagnosis.py)."""

from __future__ import annotations

from mtp_train.eval.diagnosis import SHIFT_GAP, diagnose
from mtp_train.eval.render import render_markdown
from mtp_train.eval.report import Group, SweepPoint
from test_report import make_report


def _group(alpha1: float, n: int = 4) -> Group:
    return Group(num_prompts=n, tau=1 + alpha1, alpha=[alpha1], distinct2=0.9)


def point(by_set: dict[str, float], by_cat: dict[str, float]) -> SweepPoint:
    """A k = 1, T = 0 point whose pooled α₁ is the mean of the prompt sets' (equal sizes)."""
    a1 = sum(by_set.values()) / len(by_set)
    return SweepPoint(
        k=1, temperature=0.0, tau=1 + a1, alpha=[a1], alpha_unconditional=[a1], draft_cost_ratio=0.1,
        expected_speedup=(1 + a1) / 1.1, measured_speedup=None, distinct2=0.9, lossless=True, num_prompts=8,
        num_steps=40, generated_tokens=64, by_category={k: _group(v) for k, v in by_cat.items()}, by_length={},
        by_prompt_set={k: _group(v) for k, v in by_set.items()},
    )


def test_head_decoded_on_another_distribution_is_flagged_with_the_numbers_side_by_side():
    p = point({"heldout": 0.50, "spec_bench": 0.10}, {"heldout": 0.50, "coding": 0.05, "qa": 0.15})
    d = diagnose(p, val_top1=[0.55, 0.5], val_mismatch=False)
    assert d.verdict == "distribution_shift"
    assert "DISTRIBUTION SHIFT" in d.message and "data.regenerate" in d.message
    assert d.alpha1 == 0.3 and d.val_top1 == 0.55
    assert {s.name: s.gap for s in d.by_prompt_set} == {"heldout": 0.05, "spec_bench": 0.45}
    assert [s.name for s in d.by_category] == ["coding", "heldout", "qa"]
    report = make_report(diagnosis=d, by_prompt_set=p.by_prompt_set)
    md = render_markdown(report)
    assert "Diagnosis: acceptance against validation" in md and "DISTRIBUTION SHIFT" in md
    assert "| spec_bench | 4 | 0.100 | 0.550 | +0.450 |" in md
    assert "τ by prompt set" in md


def test_consistent_head_is_not_flagged():
    p = point({"heldout": 0.52, "spec_bench": 0.48}, {"heldout": 0.52, "qa": 0.48})
    d = diagnose(p, val_top1=[0.55, 0.5], val_mismatch=False)
    assert d.verdict == "consistent" and "SHIFT" not in d.message
    assert 0.55 - d.alpha1 <= SHIFT_GAP
    assert "DISTRIBUTION SHIFT" not in render_markdown(make_report(diagnosis=d))


def test_disagreeing_validation_is_an_implementation_mismatch_whatever_the_gap():
    p = point({"heldout": 0.1}, {"heldout": 0.1})
    d = diagnose(p, val_top1=[0.55], val_mismatch=True)
    assert d.verdict == "implementation_mismatch" and "IMPLEMENTATION MISMATCH" in d.message
    assert d.alpha1 is None  # no verdict on acceptance rests on a broken implementation


def test_without_runtime_validation_nothing_is_claimed():
    d = diagnose(point({"heldout": 0.1}, {"heldout": 0.1}), val_top1=[], val_mismatch=False)
    assert d.verdict == "not_applicable"

