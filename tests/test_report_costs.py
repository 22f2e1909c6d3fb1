"""The report's cost section: the terms of c and v, the expected speedup against the measured one at every sweep point,
and what a report says where a cost could not be measured."""

from __future__ import annotations

from pathlib import Path

from mtp_train.eval.render import render_markdown, write_report
from mtp_train.eval.report import Report, compare, load_report
from test_report import _point, make_report


def test_speedups_all_below_one_are_explained():
    slow = [p.model_copy(update={"measured_speedup": 0.6, "expected_speedup": 0.9}) for p in make_report().sweep]
    md = render_markdown(make_report(sweep=slow))
    assert "Every measured speedup is below 1× (best 0.60×" in md and "accepted too rarely" in md
    costly_verify = [p.model_copy(update={"verify_cost_ratio": 1.7, "draft_cost_ratio": 0.05}) for p in slow]
    md = render_markdown(make_report(sweep=costly_verify))
    assert "verify cost v 1.70" in md and "the verify is the larger cost" in md and "compute-bound" in md
    outside = [p.model_copy(update={"expected_speedup": 1.4, "verify_cost_ratio": 1.0}) for p in slow]
    assert "the time goes outside them" in render_markdown(make_report(sweep=outside))
    assert "Every measured speedup is below 1×" not in render_markdown(make_report())  # one point is 1.4×


def test_lossless_check_divergences_and_the_terms_of_c_are_rendered(tmp_path: Path):
    from mtp_train.eval.lossless import NEAR_TIE
    from mtp_train.eval.report import DraftCost, Divergence

    sweep = [_point(k, t) for k in (1, 2) for t in (0.0, 0.7)]
    for p in sweep:
        p.cost = DraftCost(draft_forwards=40, draft_forward_ms=1.0, plain_steps=60, plain_decode_steps=52,
                           plain_decode_step_ms=12.5, spec_steps=30, verify_step_ms=15.0)
        p.verify_cost_ratio = 1.2
    gaps = [0.1] * 11 + [2.0]
    divergences = [Divergence(draft="mtp, k=2", prompt_id=f"heldout/{n}", index=n, plain_token=100 + n,
                              spec_token=200 + n, gap=g, near_tie=g < 0.5) for n, g in enumerate(gaps)]
    report = make_report(sweep=sweep, lossless=False, lossless_detail="mtp, k=2: heldout/11: generated token 11",
                         lossless_check=NEAR_TIE.format(dtype="bf16"), near_tie_nats=0.5, greedy_violations=0,
                         num_divergences=len(divergences), divergences=divergences[-10:])
    md = render_markdown(report)
    assert "Check: verify-forward argmax + near-tie divergences (bf16)" in md
    assert "Greedy violations: 0. Divergences from plain decoding: 12" in md
    assert "The first 10 of 12 divergences:" in md
    assert "| mtp, k=2 | heldout/11 | 11 | 111 | 211 | 2.000 | NO |" in md
    assert "| mtp, k=2 | heldout/2 | 2 | 102 | 202 | 0.100 | yes |" in md
    assert "**NOT LOSSLESS" in md and "near-tie divergences (bf16)): mtp, k=2: heldout/11" in md
    assert "0.080 (1.000 ms / 12.500 ms)" in md  # the headline c with its terms
    assert "| mtp | k=2 | 0 | 40 | 1.000 | 52 of 60 | 12.500 | 0.080 | 30 | — | — | — | 15.000 | 1.200 |" in md
    assert ("1.200 (15.000 ms, the step outside its drafts / 12.500 ms: taken from the speculative run itself, so the "
            "expected speedup restated the measured one") in md  # a report that predates the probe
    assert load_report(write_report(report, tmp_path, None)["json"]) == report


def test_a_report_whose_v_is_a_ratio_of_bare_forwards_gets_its_gap_without_a_split():
    """Reports from before v was over the plain decode step took v as the probed verify forward over the one-token
    forward: multiplying that v by the plain decode step mixes units, so their verify time is not split out."""
    from mtp_train.eval.report import DraftCost

    p = _point(2, 0.0)
    p.cost = DraftCost(draft_forwards=40, draft_forward_ms=1.0, plain_steps=60, plain_decode_steps=52,
                       plain_decode_step_ms=12.5, spec_steps=30, verify_step_ms=15.0, verify_forward_ms=12.0,
                       decode_forward_ms=12.5, plain_wall_s=0.75, spec_wall_s=0.6)
    p.verify_cost_ratio, p.expected_speedup, p.measured_speedup = 0.96, 2.0, 1.25
    md = render_markdown(make_report(sweep=[p]))
    assert ("0.960 (12.000 ms verify forward / 12.500 ms one-token forward, probed: a ratio of bare forwards, in other "
            "units than c's plain decode step") in md
    assert "| mtp | k=2 | 0 | 2.00× | 1.25× | +60% | 0.60 | 0.04 | — | — | 0.11 (0.10) | — |" in md, \
        "a v of bare forwards (a report from before v was over the plain decode step) is not put in plain steps"


def _costed(k: int, t: float, expected: float, measured: float, **cost):
    from mtp_train.eval.report import DraftCost

    p = _point(k, t)
    p.cost = DraftCost(**{**dict(draft_forwards=40, draft_forward_ms=1.0, plain_steps=60, plain_decode_steps=52,
                                 plain_decode_step_ms=12.5, spec_steps=30, verify_step_ms=15.0, verify_forward_ms=12.0,
                                 decode_forward_ms=12.5, plain_wall_s=0.75, spec_wall_s=0.6), **cost})
    p.verify_cost_ratio, p.expected_speedup, p.measured_speedup = 0.96, expected, measured
    return p


def test_the_gap_is_told_at_every_sweep_point_not_at_the_best_alone():
    """The best measured point is where noise ran in the speculative run's favour: its gap alone would lean toward
    measured above expected. Every point with a measured speedup gets its row, and the summary spans them all."""
    sweep = [_costed(1, 0.0, 1.5, 1.4), _costed(2, 0.0, 1.2, 1.0), _costed(1, 0.7, 0.9, 0.8),
             _costed(2, 0.7, 0.85, 0.85)]
    md = render_markdown(make_report(sweep=sweep))
    assert "| mtp | k=1 | 0 | 1.50× | 1.40× | +7% |" in md
    assert "| mtp | k=2 | 0 | 1.20× | 1.00× | +20% |" in md
    assert "| mtp | k=1 | 0.7 | 0.90× | 0.80× | +12% |" in md
    assert "| mtp | k=2 | 0.7 | 0.85× | 0.85× | +0% |" in md
    assert "Expected / measured − 1 at the 4 points: median +10%, from +0% to +20%; within 10% at 2 of 4." in md


def test_the_gap_splits_the_wall_time_with_v_in_plain_decode_steps():
    """v over the plain decode step: 30 verify steps as predicted take 30 × v × 12.5 ms, and what the loop spent
    outside its drafts beyond that is acceptance and bookkeeping."""
    p = _costed(2, 0.0, 2.0, 1.25, decode_batch_steps={4: 40, 2: 12}, verify_forward_ms=10.5, decode_forward_ms=9.0)
    p.verify_cost_ratio = 1.12  # (12.5 - 9 + 10.5) / 12.5
    md = render_markdown(make_report(sweep=[p]))
    assert "1.120 ((12.500 − 9.000 + 10.500) ms / 12.500 ms" in md
    assert ("| mtp | k=2 | 0 | 2.00× | 1.25× | +60% | 0.60 | 0.04 | 0.42 | 0.03 | 0.11 (0.10) | "
            "acceptance and bookkeeping |") in md
    assert "4 (40), 2 (12)" in md


def test_v_that_could_not_be_measured_is_said_so_not_invented():
    from mtp_train.eval.report import DraftCost

    sweep = [_point(k, t) for k in (1, 2) for t in (0.0, 0.7)]
    for p in sweep:  # the loop's own time is there; v is not, and must not be cut from it
        p.cost = DraftCost(draft_forwards=40, draft_forward_ms=1.0, plain_steps=60, plain_decode_steps=52,
                           plain_decode_step_ms=12.5, spec_steps=30, verify_step_ms=15.0)
    md = render_markdown(make_report(sweep=sweep))
    assert "| verify cost ratio v (one verify of k + 1 tokens / one plain decode step) | not measured" in md


def test_expected_speedups_with_v_in_other_units_are_not_compared(tmp_path: Path):
    """A baseline whose v was a ratio of bare forwards predicts another quantity than one whose v is over the plain
    decode step."""
    old_sweep = [_costed(k, t, 1.5, 1.4) for k in (1, 2) for t in (0.0, 0.7)]
    new_sweep = [_costed(k, t, 1.6, 1.4, decode_batch_steps={4: 52}) for k in (1, 2) for t in (0.0, 0.7)]
    old = make_report(sweep=old_sweep, verify_cost_ratio=0.96)
    new = make_report(sweep=new_sweep, verify_cost_ratio=0.96, expected_speedup=1.0)
    diff = compare(new, old, "old.json")
    assert "expected_speedup" not in diff.deltas and not diff.regressions
    assert any("expected speedup not compared" in note and "units" in note for note in diff.notes)
    assert "expected_speedup" in compare(new, make_report(sweep=new_sweep, verify_cost_ratio=0.96), "b").deltas
