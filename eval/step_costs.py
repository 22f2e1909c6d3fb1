"""The report's step costs: c and v at every sweep point with the terms they were computed from, and why every
measured speedup fell below 1× when it did (:mod:`mtp_train.eval.timing` measures them)."""

from __future__ import annotations

from mtp_train.eval.report import Report


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _headline_point(r: Report):
    return next((p for p in r.sweep if (p.k, p.temperature) == (r.k, r.temperature)), None)


def cost_terms(r: Report) -> str:
    """`` (a ms / b ms)`` for the headline point's c, empty when the report predates the record."""
    cost = getattr(_headline_point(r), "cost", None)
    return "" if cost is None else f" ({cost.draft_forward_ms:.3f} ms / {cost.plain_decode_step_ms:.3f} ms)"


def verify_cell(r: Report) -> str:
    """The headline point's v with its terms, or what the report lacks."""
    point = _headline_point(r)
    if point is None or point.verify_cost_ratio is None or point.cost is None or point.cost.verify_step_ms is None:
        return "not recorded (the expected speedup takes v = 1)"
    cost = point.cost
    if cost.verify_forward_ms is not None and cost.decode_forward_ms is not None:
        return (f"{point.verify_cost_ratio:.3f} ({cost.verify_forward_ms:.3f} ms verify forward / "
                f"{cost.decode_forward_ms:.3f} ms one-token forward, probed)")
    return (f"{point.verify_cost_ratio:.3f} ({cost.verify_step_ms:.3f} ms, the step outside its drafts / "
            f"{cost.plain_decode_step_ms:.3f} ms)")


def _setting(p) -> str:
    return f"tree {p.tree.describe()}" if getattr(p, "tree", None) is not None else f"k={p.k}"


def gap_line(name: str, p) -> str | None:
    """Where the speculative run's wall time went, against what the prediction counts, and so what its gap to the
    measured speedup is made of; ``None`` where the report predates the probe."""
    cost = p.cost
    if cost is None or cost.verify_forward_ms is None or not cost.spec_wall_s or not p.measured_speedup:
        return None
    steps = cost.spec_steps or 0
    drafts = cost.draft_forwards * cost.draft_forward_ms / 1e3
    forwards = steps * (p.verify_cost_ratio or 0.0) * cost.plain_decode_step_ms / 1e3  # v plain decode steps each
    bookkeeping = steps * cost.verify_step_ms / 1e3 - forwards  # the loop's time outside drafts beyond the forwards
    outside = cost.spec_wall_s - drafts - steps * cost.verify_step_ms / 1e3
    plain_outside = cost.plain_wall_s - cost.plain_decode_steps * cost.plain_decode_step_ms / 1e3
    gap = p.expected_speedup / p.measured_speedup - 1
    line = (f"{name}, {_setting(p)}, T={p.temperature:g}: expected {p.expected_speedup:.2f}×, measured "
            f"{p.measured_speedup:.2f}× ({gap:+.0%}). The speculative run's {cost.spec_wall_s:.2f} s: draft forwards "
            f"{drafts:.2f} s, verify forwards as probed (v decode steps each) {forwards:.2f} s, acceptance and "
            f"bookkeeping {bookkeeping:.2f} s, "
            f"prefill and mixed steps {outside:.2f} s (the plain run's {plain_outside:.2f} s of "
            f"{cost.plain_wall_s:.2f} s). ")
    if abs(gap) < 0.1:
        return line + "The prediction holds within 10%."
    if gap < 0:
        return line + (f"The measured speedup beats the prediction: a step outside its drafts took "
                       f"{cost.verify_step_ms:.1f} ms where v plain decode steps are "
                       f"{p.verify_cost_ratio * cost.plain_decode_step_ms:.1f} ms, so v, a ratio of forwards timed "
                       "alone, overstates the verify against a plain step (which also samples and books).")
    if bookkeeping >= outside - plain_outside:
        return line + ("The gap is mostly acceptance and bookkeeping: a step's time outside its drafts exceeds the "
                       "probed verify forward (the acceptance rule, page bookkeeping, the host's wait).")
    return line + ("The gap is mostly prefill and mixed steps, which do not speculate and take longer than the plain "
                   "run's (a draft's catch-up forwards ride on them).")


def cost_blocks(r: Report) -> list[tuple]:
    """The section listing c and v with their terms for every sweep point of every draft, and each draft's best
    point's account of the gap between its expected and measured speedup."""
    drafts = [(r.mode, r.sweep + r.tree_sweep)] + [(c.name, c.sweep + c.tree_sweep) for c in r.comparisons]
    rows = [[name, _setting(p), f"{p.temperature:g}", str(p.cost.draft_forwards), _ms(p.cost.draft_forward_ms),
             f"{p.cost.plain_decode_steps} of {p.cost.plain_steps}", _ms(p.cost.plain_decode_step_ms),
             _ms(p.draft_cost_ratio), "—" if p.cost.spec_steps is None else str(p.cost.spec_steps),
             _ms(p.cost.verify_forward_ms), _ms(p.cost.decode_forward_ms), _ms(p.cost.verify_step_ms),
             _ms(p.verify_cost_ratio),
             _ms(p.expected_speedup), _ms(p.measured_speedup)]
            for name, sweep in drafts
            for p in sorted(sweep, key=lambda p: (p.temperature, p.tree is not None, p.k)) if p.cost is not None]
    if not rows:
        return [("p", "This report does not record the terms of c.")]
    gaps = [line for name, sweep in drafts if sweep
            if (line := gap_line(name, max(sweep, key=lambda p: p.measured_speedup or 0))) is not None]
    return [("p", "c = mean wall time of one batched draft forward in speculative decode steps (the draft forwards "
                  "timed alone) / mean wall time of one plain decode step (a step in which every sequence decodes one "
                  "token; prefill and mixed steps are left out). v = the target's forward over a step's tokens per "
                  "sequence (k + 1, or a tree's N) with their logits / its forward over one token per sequence, both "
                  "timed alone outside the speculative loop, turn about, on contexts from the plain run. The expected speedup τ / (v + f·c), f = "
                  "k draft forwards per step for a chain (a tree's depth), 2 for a block draft, is thus a prediction: "
                  "the loop's own mean step outside its drafts (ms / step outside drafts) adds acceptance and "
                  "bookkeeping to the verify. All after a warm-up, the device synchronized around every timed "
                  "region."),
            ("table", ["draft", "setting", "T", "draft forwards", "ms / draft forward", "plain decode steps",
                       "ms / decode step", "c", "speculative steps", "ms / verify forward (probe)",
                       "ms / one-token forward (probe)",
                       "ms / step outside drafts", "v", "expected", "measured"], rows),
            *[("p", line) for line in gaps]]


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
