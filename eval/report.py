"""The release report's schema: the pydantic models behind ``report.json``, loading one, and the baseline comparison.

Conventions (``../shared/DESIGN.md``, "Evaluation: definitions used in every report"):

- **τ** counts tokens emitted per target verification step, bonus token included, pooled over all steps
  of all requests; plain decoding has τ = 1.
- **α_j** is the rate at which draft position j is accepted given that positions 1..j-1 were accepted;
  ``alpha_unconditional`` is the plain per-position rate.
- **Expected speedup** is τ / (v + f·c) (f = k draft forwards per step for a chain, 2 for a block draft), c and v
  both in plain decode steps: c the mean wall time of one batched draft forward in decode steps over that of one
  plain decode step (``draft_cost_ratio``), v a verify step predicted as a plain decode step whose one-token forward
  is widened to the verify forward of k + 1 tokens, over the plain decode step (``verify_cost_ratio``; ``None``
  where it was not measured or in reports that predate it, and the expected speedup then takes v = 1). Their terms
  are in ``SweepPoint.cost``; reports whose ``cost.decode_batch_steps`` is ``None`` took v in other units
  (:class:`mtp_train.eval.records.DraftCost`), and their expected speedups are not compared with these.
- **Lossless** (T = 0): strict token identity with plain decoding when the target runs in float32; in bf16/fp16,
  no greedy violation and every divergence from plain decoding a near-tie (:mod:`mtp_train.eval.lossless`).

Its sections are :mod:`mtp_train.eval.sections`'; rendering them (Markdown, HTML) and writing the three files is
:mod:`mtp_train.eval.render`'s.

Baseline comparison (``compare``): deltas are new minus old. A line goes into ``regressions`` when

- τ (headline and every sweep point present in both), expected speedup or validation accuracy at any
  unrolled step falls by more than 2 % relative (:data:`REL_DROP`);
- measured speedup falls by more than 5 % relative (:data:`REL_DROP_MEASURED`; wall time is noisy);
- validation loss at any unrolled step rises by more than 2 % relative (:data:`REL_RISE_LOSS`);
- ``lossless`` goes from true to false, or ``val_mismatch`` from false to true (always). ``lossless`` is
  ``None`` (n/a) when no T = 0 sweep point was checked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mtp_train.eval.diagnosis import Diagnosis
from mtp_train.eval.records import DraftCost, Divergence, EngineAcceptance, EngineCheck
from mtp_train.eval.training_curve import TrainingPoint
from mtp_train.errors import UserError

SCHEMA_VERSION = 1

REL_DROP = 0.02
"""Relative fall of τ, expected speedup or validation accuracy that counts as a regression."""
REL_DROP_MEASURED = 0.05
"""Relative fall of measured speedup that counts as a regression (wall-clock time is noisy)."""
REL_RISE_LOSS = 0.02
"""Relative rise of validation loss that counts as a regression."""

TAU_CONVENTION = (
    "τ counts tokens emitted per target verification step, bonus token included; plain decoding has τ = 1. "
    "vLLM's mean acceptance length (and SGLang's accept length) is another count of the same run, "
    "1 + accepted / drafts, given beside τ as “engine MAL”."
)

FILES = {"json": "report.json", "md": "report.md", "html": "report.html", "card": "model_card.md"}

__all__ = [
    "FILES",
    "REL_DROP",
    "REL_DROP_MEASURED",
    "REL_RISE_LOSS",
    "SCHEMA_VERSION",
    "TAU_CONVENTION",
    "BaselineDiff",
    "Comparison",
    "DraftCost",
    "Divergence",
    "EngineAcceptance",
    "EngineCheck",
    "Group",
    "Report",
    "Sample",
    "SweepPoint",
    "compare",
    "load_report",
]


class Group(BaseModel):
    """Metrics over one slice of the eval prompts (a category or a context-length bucket)."""

    model_config = ConfigDict(extra="forbid")

    num_prompts: int
    tau: float
    alpha: list[float]
    distinct2: float
    measured_speedup: float | None = None
    num_steps: int | None = None
    """Verify steps in the slice, so that slices can be pooled (α₁ is accepted first drafts / steps)."""
    draft_cost_ratio: float | None = None
    """c at this length bucket (:mod:`mtp_train.eval.context_probe`); None elsewhere and in older reports."""








class TreeSetting(BaseModel):
    """A draft tree's shape (``eval.trees``)."""

    model_config = ConfigDict(extra="forbid")

    topk: int
    depth: int
    draft_tokens: int

    def describe(self) -> str:
        return f"topk {self.topk}, depth {self.depth}, {self.draft_tokens} tokens"


class SweepPoint(BaseModel):
    """One eval run at one (k, temperature), or of one tree (``tree``; k is then its depth)."""

    model_config = ConfigDict(extra="forbid")

    k: int
    temperature: float
    tau: float
    alpha: list[float]
    alpha_unconditional: list[float]
    draft_cost_ratio: float
    expected_speedup: float
    measured_speedup: float | None
    distinct2: float
    lossless: bool | None
    verify_cost_ratio: float | None = None
    """v: a speculative step's verify in plain decode steps; ``None`` where it was not measured and in reports that
    predate it (the expected speedup takes v = 1)."""
    num_prompts: int
    num_steps: int
    generated_tokens: int
    by_category: dict[str, Group]
    by_length: dict[str, Group]
    by_prompt_set: dict[str, Group] = Field(default_factory=dict)
    cost: DraftCost | None = None
    draft_forwards_per_step: int | None = None
    """f, the draft forwards a speculative step costs: k for a chain (None in reports that predate it), 1 for a block
    draft (DFlash: its block, the context's write folded in, whatever k; 2 in reports before the fold)."""
    greedy_violations: int | None = None
    """At T = 0: emitted tokens that differ from the target's argmax in the verify forward that decided them."""
    divergences: int | None = None
    """At T = 0: prompts whose speculative output differs from plain decoding (near-ties included)."""
    engine_acceptance: EngineAcceptance | None = None
    """The same run counted as vLLM counts it; ``None`` in reports that predate it."""
    tree: TreeSetting | None = None


class Sample(BaseModel):
    """One eval prompt with the reply of the headline sweep point, to judge by eye whether the target talks sense."""

    model_config = ConfigDict(extra="forbid")

    prompt_set: str
    category: str
    prompt: str
    reply: str
    identical_to_plain: bool | None
    """Token-identical to plain decoding (checked at T = 0 only; ``None`` otherwise)."""


class Comparison(BaseModel):
    """Another draft decoded on the same prompts (another head kind, or the bigram baseline)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    sweep: list[SweepPoint]
    tree_sweep: list[SweepPoint] = Field(default_factory=list)


class BaselineDiff(BaseModel):
    """This report against an earlier one: deltas (new minus old) and the regressions they show."""

    model_config = ConfigDict(extra="forbid")

    path: str
    deltas: dict[str, float]
    regressions: list[str]
    notes: list[str] = Field(default_factory=list)
    """Differences that make the comparison less direct (another headline setting, fewer steps)."""




class Report(BaseModel):
    """The release report. Headline fields are copied from the headline sweep point."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    # Headline.
    tau: float
    alpha: list[float]
    alpha_unconditional: list[float]
    k: int
    temperature: float
    lossless: bool | None
    """Every T = 0 sweep point passed the lossless check; ``None`` (n/a) when none was at T = 0."""
    lossless_detail: str | None = None
    lossless_check: str | None = None
    """How ``lossless`` was decided (:data:`mtp_train.eval.lossless.STRICT` or the near-tie check), ``None`` in old reports."""
    near_tie_nats: float | None = None
    greedy_violations: int | None = None
    """Over every T = 0 sweep point of every draft."""
    num_divergences: int | None = None
    divergences: list[Divergence] = Field(default_factory=list)
    """The first few divergences from plain decoding at T = 0 (``num_divergences`` in all)."""
    draft_cost_ratio: float
    expected_speedup: float
    measured_speedup: float | None
    distinct2: float
    verify_cost_ratio: float | None = None
    by_category: dict[str, Group]
    by_length: dict[str, Group]
    by_prompt_set: dict[str, Group] = Field(default_factory=dict)
    diagnosis: Diagnosis | None = None
    # Validation per unrolled step.
    val_loss: list[float]
    val_acc: list[float]
    trainer_val_loss: list[float] | None = None
    trainer_val_acc: list[float] | None = None
    val_tolerance: float
    val_mismatch: bool
    # Everything measured, the context.
    sweep: list[SweepPoint]
    tree_sweep: list[SweepPoint] = Field(default_factory=list)
    """The draft trees of ``eval.trees``, at each temperature; empty where none were asked for."""
    comparisons: list[Comparison] = Field(default_factory=list)
    samples: list[Sample] = Field(default_factory=list)
    head_convention: str | None = None
    """The head's serving convention and what it means, e.g. ``native: reads the target's hidden state ...``."""
    serving: str | None = None
    """Where the head can be served as it was trained (:func:`mtp_train.heads.conventions.validity_line`)."""
    card: dict[str, str] = Field(default_factory=dict)
    """The run's facts for the model card: ``target``, ``head`` and ``data`` (:mod:`mtp_train.eval.model_card`)."""
    engine_checks: list[EngineCheck] = Field(default_factory=list)
    training: dict[str, list[TrainingPoint]] = Field(default_factory=dict)
    """Head kind -> its τ probes while it trained (``train.tau_every``; :mod:`mtp_train.eval.training_curve`)."""
    mode: str
    settings: dict[str, Any]
    versions: dict[str, str]
    device: str
    created: str
    baseline: BaselineDiff | None = None


# ---------------------------------------------------------------------------------------------------------
# Loading and comparing


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_report(path: Path) -> Report:
    """Read a report written by :func:`mtp_train.eval.render.write_report`; any problem is a one-line :class:`UserError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: report not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory; expected a report.json file") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a report (not UTF-8 text)") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the report: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a report (expected a JSON object, got {type(data).__name__})")
    if not {"tau", "sweep", "lossless"} & data.keys():
        raise UserError(f"{path}: not a report (a JSON object without the fields 'tau', 'sweep' and 'lossless')")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{path}: field 'schema_version': report schema {_short(version)}, this version of mtp-train "
            f"reads schema {SCHEMA_VERSION}"
        )
    try:
        return Report.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field"
        else:
            msg = e["msg"]
            if "input" in e and not isinstance(e["input"], (dict, list)):
                msg += f" (got {_short(e['input'])})"
        more = err.error_count() - 1
        tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        raise UserError(f"{path}: field '{where}': {msg}{tail}".replace("\n", " ")) from None


def _sweep_key(k: int, temperature: float) -> str:
    return f"tau@k={k},T={temperature:g}"


def _v_unit(r: Report) -> str | None:
    """What the headline's v is a ratio of (:class:`DraftCost`): ``None`` where it takes v = 1."""
    if r.verify_cost_ratio is None:
        return None
    point = next((p for p in r.sweep if (p.k, p.temperature) == (r.k, r.temperature)), None)
    cost = None if point is None else point.cost
    if cost is not None and cost.decode_batch_steps is not None:
        return "plain decode steps"
    if cost is not None and cost.verify_forward_ms is not None:
        return "a ratio of bare forwards"
    return "the speculative run's own step time"


def compare(report: Report, baseline: Report, path: str) -> BaselineDiff:
    """Deltas (new minus old) of ``report`` against ``baseline`` and the regressions among them.

    Thresholds are the module constants :data:`REL_DROP`, :data:`REL_DROP_MEASURED` and
    :data:`REL_RISE_LOSS`; see the module docstring.
    """
    deltas: dict[str, float] = {}
    regressions: list[str] = []
    notes: list[str] = []

    def check(name: str, new: float | None, old: float | None, *, drop: float | None = None,
              rise: float | None = None, fmt: str = ".2f") -> None:
        if new is None or old is None:
            return
        deltas[name] = new - old
        if not (math.isfinite(new) and math.isfinite(old)):
            if math.isfinite(old) and not math.isfinite(new):
                regressions.append(f"{name} was {old:{fmt}} and is now {new}")
            return
        if old == 0:
            return
        rel = (new - old) / abs(old)
        if drop is not None and rel < -drop:
            regressions.append(f"{name} fell from {old:{fmt}} to {new:{fmt}} ({rel:+.1%})")
        if rise is not None and rel > rise:
            regressions.append(f"{name} rose from {old:{fmt}} to {new:{fmt}} ({rel:+.1%})")

    if (report.k, report.temperature) != (baseline.k, baseline.temperature):
        notes.append(
            f"headline setting differs: k={report.k}, T={report.temperature:g} now, "
            f"k={baseline.k}, T={baseline.temperature:g} in the baseline"
        )
    if report.mode != baseline.mode:
        notes.append(f"mode differs: {report.mode} now, {baseline.mode} in the baseline")

    check("tau", report.tau, baseline.tau, drop=REL_DROP)
    if (report.verify_cost_ratio is None) != (baseline.verify_cost_ratio is None):
        # one side takes v = 1: the two expected speedups are not the same quantity
        notes.append("expected speedup not compared: one report measures the verify cost v, the other takes v = 1")
    elif _v_unit(report) != _v_unit(baseline):
        notes.append(f"expected speedup not compared: v is in other units ({_v_unit(report)} now, "
                     f"{_v_unit(baseline)} in the baseline)")
    else:
        check("expected_speedup", report.expected_speedup, baseline.expected_speedup, drop=REL_DROP)
    check("measured_speedup", report.measured_speedup, baseline.measured_speedup, drop=REL_DROP_MEASURED)
    check("distinct2", report.distinct2, baseline.distinct2, fmt=".3f")

    for name, new_list, old_list, kw in (
        ("val_loss", report.val_loss, baseline.val_loss, {"rise": REL_RISE_LOSS}),
        ("val_acc", report.val_acc, baseline.val_acc, {"drop": REL_DROP}),
    ):
        for j, (new, old) in enumerate(zip(new_list, old_list)):
            check(f"{name}[{j}]", new, old, fmt=".4f", **kw)
        if len(new_list) != len(old_list):
            notes.append(f"{name} has {len(new_list)} steps now, {len(old_list)} in the baseline")

    old_points = {(p.k, round(p.temperature, 6)): p for p in baseline.sweep}
    for p in report.sweep:
        old = old_points.pop((p.k, round(p.temperature, 6)), None)
        if old is None:
            notes.append(f"sweep point k={p.k}, T={p.temperature:g} is not in the baseline")
            continue
        check(_sweep_key(p.k, p.temperature), p.tau, old.tau, drop=REL_DROP)
    for k, t in old_points:
        notes.append(f"baseline sweep point k={k}, T={t:g} is not in this report")

    if baseline.lossless and report.lossless is False:
        detail = f": {report.lossless_detail}" if report.lossless_detail else ""
        regressions.append(f"lossless went from true to false{detail}")
    if report.val_mismatch and not baseline.val_mismatch:
        regressions.append(
            "val_mismatch became true: the runtime's validation numbers no longer match the trainer's"
        )
    return BaselineDiff(path=str(path), deltas=deltas, regressions=regressions, notes=notes)
