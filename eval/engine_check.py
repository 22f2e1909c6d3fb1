"""A head served by an external engine (vLLM), set against this runtime: the check's record and its report section.

The engine runs the exported head at T = 0 on the eval's prompts (``bench/vllm_check.py``). The check passes when
the engine's speculative output equals its own plain output on every prompt, and its mean acceptance length
(``1 + accepted / drafts``, vLLM's convention) and its acceptance rate at every draft position (accepted there /
drafts) are each within ``tolerance`` (relative) of this runtime's, counted the same way for the same head,
prompts, k and max tokens (:class:`mtp_train.eval.metrics.EngineCounts`).
"""

from __future__ import annotations

from mtp_train.eval.metrics import EngineCounts
from mtp_train.eval.records import EngineCheck
from mtp_train.eval.report import Report

TOLERANCE = 0.03
"""The largest relative difference of the two mean acceptance lengths that passes."""


def build_check(engine: str, date: str, k: int, prompts: int, max_new_tokens: int, identical: bool,
                theirs: EngineCounts, ours: EngineCounts, tolerance: float = TOLERANCE) -> EngineCheck:
    """The record of one k: the engine's counts (``theirs``) against this runtime's (``ours``)."""
    mal_ours, mal_theirs = ours.mean_acceptance_length, theirs.mean_acceptance_length
    diff = (mal_theirs - mal_ours) / mal_ours if mal_ours else float("inf")
    positions = [abs(e - r) / r if r else (0.0 if e == r else float("inf"))
                 for e, r in zip(theirs.position_rates, ours.position_rates, strict=True)]
    return EngineCheck(
        engine=engine, date=date, k=k, prompts=prompts, max_new_tokens=max_new_tokens, identical_to_plain=identical,
        engine_mean_acceptance_length=round(mal_theirs, 4), runtime_mean_acceptance_length=round(mal_ours, 4),
        relative_difference=round(diff, 5), engine_accepted_per_position=list(theirs.accepted_per_position),
        runtime_accepted_per_position=list(ours.accepted_per_position),
        engine_drafts=theirs.drafts, runtime_drafts=ours.drafts,
        max_position_difference=round(max(positions, default=0.0), 5),
        within_tolerance=abs(diff) <= tolerance and max(positions, default=0.0) <= tolerance, tolerance=tolerance)


def engine_mal_cell(r: Report) -> str:
    """The headline's engine MAL with its counts, or ``not recorded`` for reports that predate it."""
    point = next((p for p in r.sweep if (p.k, p.temperature) == (r.k, r.temperature)), None)
    if point is None or point.engine_acceptance is None:
        return "not recorded"
    e = point.engine_acceptance
    return f"{e.mean_acceptance_length:.2f} ({e.accepted} accepted / {e.drafts} drafts)"


def engine_check_blocks(r: Report) -> list[tuple]:
    rows = [[c.engine, c.date, str(c.k), str(c.prompts), str(c.max_new_tokens),
             "yes" if c.identical_to_plain else "NO", f"{c.engine_mean_acceptance_length:.3f}",
             f"{c.runtime_mean_acceptance_length:.3f}", f"{100 * c.relative_difference:+.2f}%",
             f"{100 * c.max_position_difference:.2f}%",
             " / ".join(map(str, c.engine_accepted_per_position)) + f" of {c.engine_drafts}",
             " / ".join(map(str, c.runtime_accepted_per_position)) + f" of {c.runtime_drafts}",
             "yes" if c.within_tolerance else "NO"] for c in r.engine_checks]
    ok = all(c.within_tolerance and c.identical_to_plain for c in r.engine_checks)
    blocks: list[tuple] = [("p", "The exported head served by the engine at T=0 on this eval's prompts, with the same k "
                                 "and max tokens (`bench/vllm_check.py`): the engine's speculative output against its "
                                 "own plain output, and its mean acceptance length and accepted counts per draft "
                                 "position against this runtime's for the same head, counted the same way, every "
                                 "prompt in one batch on both sides as vLLM schedules them (the sweep above ran at "
                                 "eval.batch_size, where admitting a request makes a step in which nothing drafts).")]
    if not ok:
        blocks.append(("flag", "ENGINE CHECK FAILED: the engine's output or acceptance differs beyond the tolerance."))
    blocks.append(("table", ["engine", "date", "k", "prompts", "max tokens", "identical to its plain output",
                             "engine MAL", "runtime MAL", "difference", "largest per-position difference",
                             "engine accepted per position",
                             "runtime accepted per position", "within tolerance"], rows))
    return blocks


