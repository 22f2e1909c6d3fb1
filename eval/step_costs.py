"""The report's step costs: c and v (both in plain decode steps) at every sweep point with the terms they were
computed from, the expected speedup's gap to the measured one at every point, and why every measured speedup fell
below 1× when it did (:mod:`mtp_train.eval.timing` measures them)."""

from __future__ import annotations

from statistics import median

from mtp_train.eval.report import Report


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _headline_point(r: Report):
    return next((p for p in r.sweep if (p.k, p.temperature) == (r.k, r.temperature)), None)


def cost_terms(r: Report) -> str:
    """`` (a ms / b ms)`` for the headline point's c, empty when the report predates the record."""
    cost = getattr(_headline_point(r), "cost", None)
    return "" if cost is None else f" ({cost.draft_forward_ms:.3f} ms / {cost.plain_decode_step_ms:.3f} ms)"


def _in_plain_steps(cost) -> bool:
    """Whether ``cost``'s report took v in plain decode steps, as c is (reports from before record no batch sizes)."""
    return cost is not None and cost.decode_batch_steps is not None


def _batches(cost) -> str:
    """The probe's batch sizes with the plain decode steps at each, ``4 (40), 2 (12)``; a range where many."""
    steps = sorted(cost.decode_batch_steps.items(), reverse=True)
    if len(steps) <= 4:
        return ", ".join(f"{b} ({n})" for b, n in steps)
    return f"{steps[-1][0]}–{steps[0][0]}: {len(steps)} sizes ({sum(n for _, n in steps)} steps)"


def verify_cell(r: Report) -> str:
    """The headline point's v with its terms, or what the report lacks."""
    point = _headline_point(r)
    cost = getattr(point, "cost", None)
    v = getattr(point, "verify_cost_ratio", None)
    if cost is None or (v is None and cost.verify_step_ms is None):
        return "not recorded (the expected speedup takes v = 1)"
    if v is None:
        return ("not measured (no verify probe at this point; the expected speedup takes v = 1, the textbook "
                "τ / (1 + k·c))")
    if _in_plain_steps(cost):
        return (f"{v:.3f} (({cost.plain_decode_step_ms:.3f} − {cost.decode_forward_ms:.3f} + "
                f"{cost.verify_forward_ms:.3f}) ms / {cost.plain_decode_step_ms:.3f} ms: the plain decode step with "
                "its one-token forward widened to the verify forward, both probed at the plain run's batch sizes, "
                f"{_batches(cost)} decode steps)")
    if cost.verify_forward_ms is not None and cost.decode_forward_ms is not None:
        return (f"{v:.3f} ({cost.verify_forward_ms:.3f} ms verify forward / {cost.decode_forward_ms:.3f} ms one-token "
                "forward, probed: a ratio of bare forwards, in other units than c's plain decode step; a report from "
                "before v was in plain decode steps)")
    return (f"{v:.3f} ({cost.verify_step_ms:.3f} ms, the step outside its drafts / {cost.plain_decode_step_ms:.3f} ms: "
            "taken from the speculative run itself, so the expected speedup restated the measured one; a report "
            "from before v was probed)")


def _setting(p) -> str:
    return f"tree {p.tree.describe()}" if getattr(p, "tree", None) is not None else f"k={p.k}"


GAP_HEADERS = ["draft", "setting", "T", "expected", "measured", "expected / measured − 1", "speculative run s",
               "draft forwards s", "verify steps as predicted s", "acceptance and bookkeeping s",
               "prefill and mixed steps s (plain run's)", "mostly"]


def gap_row(name: str, p) -> tuple[list[str], float] | None:
    """One sweep point's row of the gap table and its gap (expected / measured − 1): where the speculative run's wall
    time went, against what the prediction counts; ``None`` where the report predates the wall times. The verify
    time is split out only where v is in plain decode steps, as c is."""
    cost = p.cost
    if cost is None or not cost.spec_wall_s or cost.plain_wall_s is None or not p.measured_speedup:
        return None
    steps = cost.spec_steps or 0
    drafts = cost.draft_forwards * cost.draft_forward_ms / 1e3
    loop = steps * (cost.verify_step_ms or 0.0) / 1e3  # the speculative steps' time outside their drafts
    outside = cost.spec_wall_s - drafts - loop
    plain_outside = cost.plain_wall_s - cost.plain_decode_steps * cost.plain_decode_step_ms / 1e3
    gap = p.expected_speedup / p.measured_speedup - 1
    forwards = bookkeeping = mostly = "—"
    if _in_plain_steps(cost) and p.verify_cost_ratio is not None:
        predicted = steps * p.verify_cost_ratio * cost.plain_decode_step_ms / 1e3  # v plain decode steps each
        forwards, bookkeeping = f"{predicted:.2f}", f"{loop - predicted:.2f}"
        mostly = ("within 10%" if abs(gap) < 0.1 else "measured beats the prediction" if gap < 0
                  else "acceptance and bookkeeping" if loop - predicted >= outside - plain_outside
                  else "prefill and mixed steps")
    return ([name, _setting(p), f"{p.temperature:g}", f"{p.expected_speedup:.2f}×", f"{p.measured_speedup:.2f}×",
             f"{gap:+.0%}", f"{cost.spec_wall_s:.2f}", f"{drafts:.2f}", forwards, bookkeeping,
             f"{outside:.2f} ({plain_outside:.2f})", mostly], gap)


def gap_blocks(drafts: list[tuple[str, list]]) -> list[tuple]:
    """The gap between the expected and the measured speedup at every sweep point of every draft (``drafts``: name
    and points), with a summary over them all; empty where no point records its wall times."""
    rows = [row for name, sweep in drafts for p in _ordered(sweep) if (row := gap_row(name, p)) is not None]
    if not rows:
        return []
    gaps = [gap for _, gap in rows]
    within = sum(abs(g) < 0.1 for g in gaps)
    blocks = [("p", "The expected speedup against the measured one at every sweep point (the best measured point "
                    "alone would be where noise favoured the speculative run). Each speculative run's wall time is "
                    "split into its draft forwards (timed), its verify steps as predicted (v plain decode steps "
                    "each: a plain decode step with its forward widened to the verify's), acceptance and bookkeeping "
                    "(the loop's time outside its drafts beyond that prediction) and prefill and mixed steps (the "
                    "rest of the run; in brackets the plain run's time outside its decode steps). “mostly” names "
                    "the larger part the prediction missed: acceptance and bookkeeping, or prefill and mixed steps, "
                    "which do not speculate (a draft's catch-up forwards ride on them). Where the measured speedup "
                    "beats the prediction, the loop's steps outside their drafts took less than predicted: the "
                    "verify step sampled and booked for less than a plain step does, or the speculative run's batch "
                    "sizes were not the plain run's."),
              ("table", GAP_HEADERS, [row for row, _ in rows]),
              ("p", f"Expected / measured − 1 at the {len(gaps)} point{'s' if len(gaps) > 1 else ''}: median "
                    f"{median(gaps):+.0%}, from {min(gaps):+.0%} to {max(gaps):+.0%}; within 10% at {within} of "
                    f"{len(gaps)}.")]
    if any(row[8] == "—" for row, _ in rows):
        blocks.append(("p", "— in the split: v was not measured at that point, or the report took v as a ratio of "
                            "bare forwards or from the speculative run itself, not in plain decode steps as c is, "
                            "so its verify time is not split out."))
    return blocks


def _ordered(sweep: list) -> list:
    return sorted(sweep, key=lambda p: (p.temperature, p.tree is not None, p.k))


def cost_blocks(r: Report) -> list[tuple]:
    """The section listing c and v with their terms for every sweep point of every draft, and the gap between the
    expected and the measured speedup at each of them."""
    drafts = [(r.mode, r.sweep + r.tree_sweep)] + [(c.name, c.sweep + c.tree_sweep) for c in r.comparisons]
    rows = [[name, _setting(p), f"{p.temperature:g}", str(p.cost.draft_forwards), _ms(p.cost.draft_forward_ms),
             f"{p.cost.plain_decode_steps} of {p.cost.plain_steps}", _ms(p.cost.plain_decode_step_ms),
             _ms(p.draft_cost_ratio), "—" if p.cost.spec_steps is None else str(p.cost.spec_steps),
             _ms(p.cost.verify_forward_ms), _ms(p.cost.decode_forward_ms),
             _batches(p.cost) if _in_plain_steps(p.cost) else "—", _ms(p.cost.verify_step_ms),
             _ms(p.verify_cost_ratio),
             _ms(p.expected_speedup), _ms(p.measured_speedup)]
            for name, sweep in drafts
            for p in _ordered(sweep) if p.cost is not None]
    if not rows:
        return [("p", "This report does not record the terms of c.")]
    return [("p", "c and v are both in plain decode steps, the unit the plain run measured: c = mean wall time of one "
                  "batched draft forward in speculative decode steps (the draft forwards timed alone) / mean wall "
                  "time of one plain decode step (a step in which every sequence decodes one token, with its "
                  "scheduling, sampling and bookkeeping; prefill and mixed steps are left out). v = (plain decode "
                  "step − one-token forward + verify forward) / plain decode step: the verify predicted as a plain "
                  "decode step whose forward is widened to the step's tokens per sequence (k + 1, or a tree's N) with "
                  "their logits. The two forwards are timed alone outside the speculative loop, turn about, on "
                  "contexts from the plain run, at the batch sizes its decode steps ran at (as requests finish a "
                  "batch shrinks) and weighed by the decode steps at each (probe batch sizes: size (decode steps)). "
                  "Where v could not be measured the report says so; it is never taken from the speculative run "
                  "(ms / step outside drafts, given for comparison), which it predicts. The expected speedup "
                  "τ / (v + f·c), f = k draft forwards per step for a chain (a tree's depth), 2 for a block draft, is "
                  "thus a prediction. All after a warm-up, the device synchronized around every timed region."),
            ("table", ["draft", "setting", "T", "draft forwards", "ms / draft forward", "plain decode steps",
                       "ms / decode step", "c", "speculative steps", "ms / verify forward (probe)",
                       "ms / one-token forward (probe)", "probe batch sizes (decode steps)",
                       "ms / step outside drafts", "v", "expected", "measured"], rows),
            *gap_blocks(drafts)]


def speedup_note(points: list) -> str | None:
    """Why every measured speedup is below 1×, and what would change it; ``None`` when one is not.

    ``points`` are ``SweepPoint``s. A speculative step costs one target forward over k + 1 tokens (v plain decode
    steps, measured) plus k draft forwards (c each): speculation pays when τ exceeds v + k·c. v is near 1 on a
    memory-bound target (a GPU at small batch) and grows toward k + 1 on a compute-bound one.
    """
    measured = [p for p in points if p.measured_speedup is not None]
    if not measured or any(p.measured_speedup >= 1 for p in measured):
        return None
    best = max(measured, key=lambda p: p.measured_speedup)
    v = best.verify_cost_ratio
    drafts = (best.draft_forwards_per_step or best.k) * best.draft_cost_ratio
    head = (f"Every measured speedup is below 1× (best {best.measured_speedup:.2f}× at k={best.k}, "
            f"T={best.temperature:g}: τ {best.tau:.2f}, draft cost c {best.draft_cost_ratio:.2f}, verify cost v "
            + ("not recorded" if v is None else f"{v:.2f}") + f", expected {best.expected_speedup:.2f}×). ")
    if best.expected_speedup >= 1:
        why = ("τ beats the decode steps' costs, so the time goes outside them: prefill and mixed steps, which "
               "do not speculate, or a noisy machine; rerun on a quiet one.")
    elif v is not None and v - 1 > drafts:
        why = (f"Speculation pays when τ exceeds v + k·c ({v + drafts:.2f} here), and the verify is the larger "
               f"cost: checking {best.k + 1} tokens costs {v:.2f} plain decode steps, so the target is compute-"
               "bound here (a CPU, or a large batch). On a memory-bound target (a GPU at small batch) v is near 1.")
    else:
        why = (f"Speculation pays when τ exceeds v + k·c ({(v or 1.0) + drafts:.2f} here), and the drafts are "
               "the larger cost: the head is accepted too rarely for what a draft step costs. A better head (more "
               "training data, the target's own answers on prompts like these) raises τ; a cheaper draft lowers c.")
    return head + why
