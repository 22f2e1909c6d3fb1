"""The release report's sections, in the order the report shows them: one list, two renderers (:mod:`mtp_train.eval.render`).

A section is ``(title, blocks)``; a block is one of

- ``("p", text)``: a paragraph
- ``("flag", text)``: a warning that must stand out (REGRESSION, MISMATCH, NOT LOSSLESS)
- ``("table", headers, rows)``: a table of strings
- ``("pre", text)``: preformatted text (JSON when it starts with "{")
- ``("img", key)``: a plot (HTML only)

Each step below builds one section from the report, or ``None`` where the report has nothing for it;
:func:`sections` lists the steps in order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from mtp_train.eval.diagnosis import diagnosis_blocks
from mtp_train.eval.engine_check import engine_check_blocks, engine_mal_cell
from mtp_train.eval.lossless import lossless_blocks
from mtp_train.eval.plots import bucket_order, headline_groups
from mtp_train.eval.report import (
    REL_DROP,
    REL_DROP_MEASURED,
    REL_RISE_LOSS,
    TAU_CONVENTION,
    Report,
    Sample,
    SweepPoint,
)
from mtp_train.eval.step_costs import cost_blocks, cost_terms, speedup_note, verify_cell
from mtp_train.eval.trees import best_tree_cell, tree_table

__all__ = ["Block", "Section", "sample_blocks", "sections"]

Block = tuple
Section = tuple[str, list[Block]]


def _num(x: float | None, digits: int = 2, suffix: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}{suffix}"


def _alphas(values: list[float]) -> str:
    return ", ".join(_num(a, 3) for a in values) or "—"


def _lossless_cell(v: bool | None) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}" if math.isfinite(x) else str(x)


def _setting(r: Report) -> str:
    """The headline setting, as the titles of the sections measured there name it."""
    return f"chain k={r.k}, T={r.temperature:g}"


def _by_setting(sweep: list[SweepPoint]) -> list[SweepPoint]:
    return sorted(sweep, key=lambda p: (p.temperature, p.k))


def _group_table(groups: dict[str, Any], order: list[str]) -> Block:
    rows = [
        [n, str(g.num_prompts), _num(g.tau), _alphas(g.alpha), _num(g.distinct2, 3), _num(g.measured_speedup, 2, "×")]
        for n, g in ((n, groups[n]) for n in order)
    ]
    return ("table", ["group", "prompts", "τ", "α_j conditional (j = 1..k)", "distinct-2", "measured speedup"], rows)


def _headline_flags(r: Report) -> list[Block]:
    """The warnings the headline opens with: a regression, a validation mismatch, a failed lossless check."""
    flags: list[Block] = []
    if r.baseline and r.baseline.regressions:
        flags.append(("flag", f"REGRESSION against the baseline {r.baseline.path}: "
                              f"{len(r.baseline.regressions)} finding(s), listed under “Baseline comparison”."))
    if r.val_mismatch:
        flags.append(("flag", "MISMATCH: the runtime's validation numbers differ from the trainer's beyond the "
                              f"tolerance {r.val_tolerance:g}."))
    if r.lossless is False:
        flags.append(("flag", f"NOT LOSSLESS: speculative decoding at T=0 failed the check "
                              f"({r.lossless_check or 'token identity with plain greedy decoding'})"
                              + (f": {r.lossless_detail}" if r.lossless_detail else "") + "."))
    return flags


def _headline_table(r: Report) -> Block:
    return ("table", ["metric", "value"], [
        ["mode", r.mode],
        ["headline setting", _setting(r)],
        ["τ (tokens per target step, bonus included)", _num(r.tau)],
        ["engine MAL: vLLM's mean acceptance length, 1 + accepted / drafts", engine_mal_cell(r)],
        ["draft cost ratio c (one draft forward / one plain decode step)",
         _num(r.draft_cost_ratio, 3) + cost_terms(r)],
        ["verify cost ratio v (one verify of k + 1 tokens / one plain decode step)", verify_cell(r)],
        ["expected speedup τ / (v + k·c)", _num(r.expected_speedup, 2, "×")],
        ["measured speedup (plain / speculative wall time)", _num(r.measured_speedup, 2, "×")],
        ["distinct-2", _num(r.distinct2, 3)],
        ["lossless (every T=0 sweep point)", _lossless_cell(r.lossless) + (" (no T=0 sweep point)"
                                                                           if r.lossless is None else "")],
        ["validation vs trainer", "MISMATCH" if r.val_mismatch else "agree within tolerance"],
        *([["serving conventions", f"{r.head_convention}. {r.serving or ''}".strip()]] if r.head_convention else []),
        *([["best draft tree (eval.trees)", tree]] if (tree := best_tree_cell(r)) else []),
    ])


def headline(r: Report) -> Section:
    """The τ convention, the warnings, the headline numbers and, where it applies, why the speedups are low."""
    blocks: list[Block] = [("p", TAU_CONVENTION), *_headline_flags(r), _headline_table(r)]
    note = speedup_note(r.sweep)
    if note is not None:
        blocks.append(("p", note))
    return (f"Headline ({_setting(r)})", blocks)


def diagnosis(r: Report) -> Section | None:
    if r.diagnosis is None:
        return None
    return ("Diagnosis: acceptance against validation", diagnosis_blocks(r.diagnosis))


def alpha_by_position(r: Report) -> Section:
    n = max(len(r.alpha), len(r.alpha_unconditional))
    rows = [
        [str(j + 1),
         _num(r.alpha[j], 3) if j < len(r.alpha) else "—",
         _num(r.alpha_unconditional[j], 3) if j < len(r.alpha_unconditional) else "—"]
        for j in range(n)
    ]
    return (f"α by draft position ({_setting(r)})", [
        ("p", "Conditional α_j: the rate at which position j is accepted given that positions 1..j−1 were "
              "accepted. Unconditional: the rate at which position j is accepted at all."),
        ("table", ["position j", "α_j conditional", "α_j unconditional"], rows),
        ("img", "alpha"),
    ])


def sweep_table(r: Report) -> Section:
    rows = [
        [str(p.k), f"{p.temperature:g}", _num(p.tau), _alphas(p.alpha), _num(p.draft_cost_ratio, 3),
         _num(p.verify_cost_ratio, 3), _num(p.expected_speedup, 2, "×"), _num(p.measured_speedup, 2, "×"),
         _num(p.distinct2, 3),
         _lossless_cell(p.lossless), str(p.num_prompts), str(p.num_steps), str(p.generated_tokens),
         "—" if p.engine_acceptance is None else _num(p.engine_acceptance.mean_acceptance_length)]
        for p in _by_setting(r.sweep)
    ]
    return ("Sweep over k and temperature", [
        ("p", "Lossless is checked at T=0 only (n/a otherwise). Engine MAL is vLLM's mean acceptance length, "
              "1 + accepted / drafts over the steps that verified drafts, accepted counted before a stop token or "
              "the length limit cut the output: compare it, not τ, with what vLLM or SGLang print."),
        ("table", ["k", "T", "τ", "α_j conditional", "c", "v", "expected speedup", "measured speedup",
                   "distinct-2", "lossless", "prompts", "steps", "tokens", "engine MAL"], rows),
        ("img", "tau_by_k"),
        ("img", "speedup_by_k"),
    ])


def engine_checks(r: Report) -> Section | None:
    if not r.engine_checks:
        return None
    return ("Served by an engine", engine_check_blocks(r))


def draft_and_verify_costs(r: Report) -> Section:
    return ("Draft cost c and verify cost v: what they were computed from", cost_blocks(r))


def by_category(r: Report) -> Section:
    return (f"τ by prompt category ({_setting(r)})", [
        _group_table(r.by_category, sorted(r.by_category)) if r.by_category else ("p", "No categories recorded."),
        ("img", "tau_by_group"),
    ])


def by_prompt_set(r: Report) -> Section | None:
    if not r.by_prompt_set:
        return None
    return (f"τ by prompt set ({_setting(r)})", [_group_table(r.by_prompt_set, sorted(r.by_prompt_set))])


def by_length(r: Report) -> Section:
    """Every draft's τ, α by position and c in each context-length bucket."""
    rows = [[name, n, str(g.num_prompts), _num(g.tau), _alphas(g.alpha), _num(g.draft_cost_ratio, 3)]
            for name, groups in headline_groups(r, "by_length")
            for n, g in ((n, groups[n]) for n in sorted(groups, key=bucket_order))]
    return (f"τ, α and c by context length in tokens ({_setting(r)})", [
        ("table", ["draft", "prompt tokens", "prompts", "τ", "α_j conditional (j = 1..k)",
                   "c (draft forward / plain decode step, batch 1)"], rows) if rows
        else ("p", "No context-length buckets recorded."),
        ("img", "tau_by_length"),
    ])


def training(r: Report) -> Section:
    """The τ probes of every head while it trained (``train.tau_every``)."""
    rows = [[name, str(p.step), f"{p.train_tokens:,}", _num(p.tau, 3), _num(p.alpha1, 3), _num(p.val_top1, 3)]
            for name, points in r.training.items() for p in points]
    return ("τ while the heads trained", [
        ("p", "Held-out prompts decoded greedily by the runtime with each head as it stood, at the recipe's largest "
              "k, every train.tau_every steps: a few prompts and tokens each, so read the late points against the "
              "eval above." if rows else "No τ probes: the heads trained with train.tau_every 0."),
        *([("table", ["head", "step", "training tokens", "τ", "α₁", "val top-1 (step 1)"], rows)] if rows else []),
        ("img", "training"),
    ])


def other_drafts(r: Report) -> Section | None:
    """This report's sweep beside the sweep of every other draft decoded on the same prompts."""
    if not r.comparisons:
        return None
    rows = [
        [name, str(p.k), f"{p.temperature:g}", _num(p.tau), _alphas(p.alpha), _num(p.draft_cost_ratio, 3),
         _num(p.expected_speedup, 2, "×"), _num(p.measured_speedup, 2, "×"), _lossless_cell(p.lossless)]
        for name, sweep in [(f"{r.mode} (this report)", r.sweep)] + [(c.name, c.sweep) for c in r.comparisons]
        for p in _by_setting(sweep)
    ]
    return ("Other drafts on the same prompts", [
        ("p", "Every draft decodes the same prompts with the same target, over the same k and temperatures. "
              "The bigram baseline drafts the most frequent successor of each token in the training "
              "features (no neural network; cost close to zero)."),
        ("table", ["draft", "k", "T", "τ", "α_j conditional", "c", "expected speedup", "measured speedup",
                   "lossless"], rows),
    ])


def _at(values: list[float] | None, j: int) -> float | None:
    return values[j] if values is not None and j < len(values) else None


def _diff(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else _signed(a - b, 4)


def _validation_rows(r: Report) -> list[list[str]]:
    """Per unrolled step: the runtime's and the trainer's loss and accuracy, and their differences."""
    steps = max(len(r.val_loss), len(r.val_acc), len(r.trainer_val_loss or []), len(r.trainer_val_acc or []))
    rows = []
    for j in range(steps):
        loss, tloss = _at(r.val_loss, j), _at(r.trainer_val_loss, j)
        acc, tacc = _at(r.val_acc, j), _at(r.trainer_val_acc, j)
        rows.append([str(j), _num(loss, 4), _num(tloss, 4), _diff(loss, tloss),
                     _num(acc, 4), _num(tacc, 4), _diff(acc, tacc)])
    return rows


def validation(r: Report) -> Section:
    blocks: list[Block] = [("p", "Teacher-forced loss and accuracy per unrolled step, computed by the runtime's "
                                 "target and head on held-out sequences, next to the trainer's own validation "
                                 f"numbers. Tolerance: {r.val_tolerance:g}.")]
    if r.val_mismatch:
        blocks.append(("flag", "MISMATCH: runtime and trainer validation differ by more than the tolerance "
                               f"{r.val_tolerance:g}."))
    else:
        blocks.append(("p", "Runtime and trainer validation agree within the tolerance."
                       if r.trainer_val_loss is not None or r.trainer_val_acc is not None
                       else "The trainer recorded no validation numbers to compare with."))
    blocks.append(("table", ["step", "val loss (runtime)", "val loss (trainer)", "Δ loss",
                             "val acc (runtime)", "val acc (trainer)", "Δ acc"], _validation_rows(r)))
    return ("Validation per unrolled step", blocks)


def lossless_check(r: Report) -> Section:
    return ("Lossless check", lossless_blocks(r))


def sample_blocks(samples: list[Sample]) -> list[Block]:
    """Each sample as a heading line and its prompt and reply as preformatted text."""
    blocks: list[Block] = [("p", "A few eval prompts per prompt set, with the reply of the headline sweep point. "
                                 "“identical” means token-identical to plain decoding (checked at T=0 only).")]
    for i, s in enumerate(samples, 1):
        mark = {True: "identical to plain decoding", False: "DIFFERS from plain decoding",
                None: "not compared (T > 0)"}[s.identical_to_plain]
        blocks.append(("p", f"{i}. {s.prompt_set} / {s.category}: {mark}"))
        blocks.append(("pre", f"PROMPT\n{s.prompt}\n\nREPLY\n{s.reply}"))
    return blocks


def text_samples(r: Report) -> Section | None:
    if not r.samples:
        return None
    return (f"Text samples ({_setting(r)})", sample_blocks(r.samples))


def baseline_comparison(r: Report) -> Section | None:
    """What changed against the baseline report: its regressions, its notes, every delta."""
    if r.baseline is None:
        return None
    b = r.baseline
    blocks: list[Block] = [
        ("p", f"Baseline: {b.path}. Deltas are this report minus the baseline. A regression is a relative "
              f"fall of more than {REL_DROP:.0%} in τ, expected speedup or validation accuracy, more than "
              f"{REL_DROP_MEASURED:.0%} in measured speedup, a rise of more than {REL_RISE_LOSS:.0%} in "
              "validation loss, lossless turning false or a new validation mismatch.")]
    if b.regressions:
        blocks += [("flag", f"REGRESSION: {line}") for line in b.regressions]
    else:
        blocks.append(("p", "No regressions against the baseline."))
    blocks += [("p", f"Note: {line}") for line in b.notes]
    blocks.append(("table", ["metric", "Δ (new − old)"], [[name, _signed(d, 4)] for name, d in b.deltas.items()]))
    return ("Baseline comparison", blocks)


def context(r: Report) -> Section:
    return ("Settings, versions, device", [
        ("p", f"Device: {r.device}. Created: {r.created}. Report schema {r.schema_version}."),
        ("table", ["package", "version"], [[k, v] for k, v in sorted(r.versions.items())]),
        ("pre", json.dumps(r.settings, indent=2, sort_keys=True, default=str, ensure_ascii=False)),
    ])


STEPS: tuple[Callable[[Report], Section | None], ...] = (
    headline, diagnosis, alpha_by_position, sweep_table, tree_table, engine_checks, draft_and_verify_costs,
    by_category, by_prompt_set, by_length, other_drafts, training,
    validation, lossless_check, text_samples, baseline_comparison, context,
)
"""The report's sections in the order it shows them."""


def sections(report: Report) -> list[Section]:
    """The report's sections, in order; a step with nothing to show gives none."""
    return [section for step in STEPS if (section := step(report)) is not None]
