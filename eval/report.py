"""The release report: a schema, a baseline comparison, and JSON, Markdown and HTML renderers.

Conventions (``../shared/DESIGN.md``, "Evaluation: definitions used in every report"):

- **τ** counts tokens emitted per target verification step, bonus token included, pooled over all steps
  of all requests; plain decoding has τ = 1.
- **α_j** is the rate at which draft position j is accepted given that positions 1..j-1 were accepted;
  ``alpha_unconditional`` is the plain per-position rate.
- **Expected speedup** is τ / (1 + k·c), with c the measured cost of one draft step relative to one target
  step (``draft_cost_ratio``).

``write_report`` writes ``report.json``, ``report.md`` and a self-contained ``report.html`` (inline CSS, four
PNG plots embedded as data URIs, no JavaScript). Everything is rendered in memory first and each file is
written atomically, so a failure leaves no partial file behind.

Baseline comparison (``compare``): deltas are new minus old. A line goes into ``regressions`` when

- τ (headline and every sweep point present in both), expected speedup or validation accuracy at any
  unrolled step falls by more than 2 % relative (:data:`REL_DROP`);
- measured speedup falls by more than 5 % relative (:data:`REL_DROP_MEASURED`; wall time is noisy);
- validation loss at any unrolled step rises by more than 2 % relative (:data:`REL_RISE_LOSS`);
- ``lossless`` goes from true to false, or ``val_mismatch`` from false to true (always).
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eval.diagnosis import Diagnosis, diagnosis_blocks
from mtp_train.errors import UserError
from mtp_train.io import write_atomic, write_json_atomic

SCHEMA_VERSION = 1

REL_DROP = 0.02
"""Relative fall of τ, expected speedup or validation accuracy that counts as a regression."""
REL_DROP_MEASURED = 0.05
"""Relative fall of measured speedup that counts as a regression (wall-clock time is noisy)."""
REL_RISE_LOSS = 0.02
"""Relative rise of validation loss that counts as a regression."""

TAU_CONVENTION = (
    "τ counts tokens emitted per target verification step, bonus token included; plain decoding has τ = 1."
)

FILES = {"json": "report.json", "md": "report.md", "html": "report.html"}

__all__ = [
    "FILES",
    "REL_DROP",
    "REL_DROP_MEASURED",
    "REL_RISE_LOSS",
    "SCHEMA_VERSION",
    "TAU_CONVENTION",
    "BaselineDiff",
    "Group",
    "Report",
    "SweepPoint",
    "compare",
    "load_report",
    "render_html",
    "render_markdown",
    "write_report",
]


class Group(BaseModel):
    """Metrics over one slice of the eval prompts (a category or a context-length bucket)."""

    model_config = ConfigDict(extra="forbid")

    num_prompts: int
    tau: float
    alpha: list[float]
    distinct2: float
    measured_speedup: float | None = None


class SweepPoint(BaseModel):
    """One eval run at one (k, temperature)."""

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
    num_prompts: int
    num_steps: int
    generated_tokens: int
    by_category: dict[str, Group]
    by_length: dict[str, Group]
    by_prompt_set: dict[str, Group] = Field(default_factory=dict)


class Comparison(BaseModel):
    """Another draft decoded on the same prompts (another head kind, or the bigram baseline)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    sweep: list[SweepPoint]


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
    lossless: bool
    lossless_detail: str | None = None
    draft_cost_ratio: float
    expected_speedup: float
    measured_speedup: float | None
    distinct2: float
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
    comparisons: list[Comparison] = Field(default_factory=list)
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
    """Read a report written by :func:`write_report`; any problem is a one-line :class:`UserError`."""
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

    if baseline.lossless and not report.lossless:
        detail = f": {report.lossless_detail}" if report.lossless_detail else ""
        regressions.append(f"lossless went from true to false{detail}")
    if report.val_mismatch and not baseline.val_mismatch:
        regressions.append(
            "val_mismatch became true: the runtime's validation numbers no longer match the trainer's"
        )
    return BaselineDiff(path=str(path), deltas=deltas, regressions=regressions, notes=notes)


# ---------------------------------------------------------------------------------------------------------
# Rendering: one list of sections, two renderers (Markdown, HTML).
#
# A section is (title, blocks); a block is one of
#   ("p", text)                   a paragraph
#   ("flag", text)                a warning that must stand out (REGRESSION, MISMATCH, NOT LOSSLESS)
#   ("table", headers, rows)      a table of strings
#   ("pre", text)                 preformatted text
#   ("img", key)                  a plot (HTML only)


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


def _group_table(groups: dict[str, Any], order: list[str]) -> tuple:
    rows = [
        [n, str(g.num_prompts), _num(g.tau), _alphas(g.alpha), _num(g.distinct2, 3), _num(g.measured_speedup, 2, "×")]
        for n, g in ((n, groups[n]) for n in order)
    ]
    return ("table", ["group", "prompts", "τ", "α_j conditional (j = 1..k)", "distinct-2", "measured speedup"], rows)


def _sections(report: Report) -> list[tuple[str, list[tuple]]]:
    from eval.plots import bucket_order

    r = report
    sections: list[tuple[str, list[tuple]]] = []
    setting = f"k={r.k}, T={r.temperature:g}"

    # Headline.
    blocks: list[tuple] = [("p", TAU_CONVENTION)]
    if r.baseline and r.baseline.regressions:
        blocks.append(("flag", f"REGRESSION against the baseline {r.baseline.path}: "
                               f"{len(r.baseline.regressions)} finding(s), listed under “Baseline comparison”."))
    if r.val_mismatch:
        blocks.append(("flag", "MISMATCH: the runtime's validation numbers differ from the trainer's beyond the "
                               f"tolerance {r.val_tolerance:g}."))
    if not r.lossless:
        blocks.append(("flag", "NOT LOSSLESS: speculative output differs from plain greedy decoding at T=0"
                               + (f" ({r.lossless_detail})" if r.lossless_detail else "") + "."))
    blocks.append(("table", ["metric", "value"], [
        ["mode", r.mode],
        ["headline setting", setting],
        ["τ (tokens per target step, bonus included)", _num(r.tau)],
        ["draft cost ratio c (one draft step / one target step)", _num(r.draft_cost_ratio, 3)],
        ["expected speedup τ / (1 + k·c)", _num(r.expected_speedup, 2, "×")],
        ["measured speedup (plain / speculative wall time)", _num(r.measured_speedup, 2, "×")],
        ["distinct-2", _num(r.distinct2, 3)],
        ["lossless (every T=0 sweep point)", "yes" if r.lossless else "NO"],
        ["validation vs trainer", "MISMATCH" if r.val_mismatch else "agree within tolerance"],
    ]))
    sections.append((f"Headline ({setting})", blocks))
    if r.diagnosis is not None:
        sections.append(("Diagnosis: acceptance against validation", diagnosis_blocks(r.diagnosis)))

    # α by position.
    n = max(len(r.alpha), len(r.alpha_unconditional))
    rows = [
        [str(j + 1),
         _num(r.alpha[j], 3) if j < len(r.alpha) else "—",
         _num(r.alpha_unconditional[j], 3) if j < len(r.alpha_unconditional) else "—"]
        for j in range(n)
    ]
    sections.append((f"α by draft position ({setting})", [
        ("p", "Conditional α_j: the rate at which position j is accepted given that positions 1..j−1 were "
              "accepted. Unconditional: the rate at which position j is accepted at all."),
        ("table", ["position j", "α_j conditional", "α_j unconditional"], rows),
        ("img", "alpha"),
    ]))

    # Sweep.
    rows = [
        [str(p.k), f"{p.temperature:g}", _num(p.tau), _alphas(p.alpha), _num(p.draft_cost_ratio, 3),
         _num(p.expected_speedup, 2, "×"), _num(p.measured_speedup, 2, "×"), _num(p.distinct2, 3),
         _lossless_cell(p.lossless), str(p.num_prompts), str(p.num_steps), str(p.generated_tokens)]
        for p in sorted(r.sweep, key=lambda p: (p.temperature, p.k))
    ]
    sections.append(("Sweep over k and temperature", [
        ("p", "Lossless is checked token for token at T=0 only (n/a otherwise)."),
        ("table", ["k", "T", "τ", "α_j conditional", "c", "expected speedup", "measured speedup", "distinct-2",
                   "lossless", "prompts", "steps", "tokens"], rows),
        ("img", "tau_by_k"),
    ]))

    sections.append((f"τ by prompt category ({setting})", [
        _group_table(r.by_category, sorted(r.by_category)) if r.by_category else ("p", "No categories recorded."),
        ("img", "tau_by_category"),
    ]))
    if r.by_prompt_set:
        sections.append((f"τ by prompt set ({setting})", [_group_table(r.by_prompt_set, sorted(r.by_prompt_set))]))
    sections.append((f"τ by context length in tokens ({setting})", [
        _group_table(r.by_length, sorted(r.by_length, key=bucket_order)) if r.by_length
        else ("p", "No context-length buckets recorded."),
        ("img", "tau_by_length"),
    ]))

    # Other drafts on the same prompts.
    if r.comparisons:
        rows = [
            [name, str(p.k), f"{p.temperature:g}", _num(p.tau), _alphas(p.alpha), _num(p.draft_cost_ratio, 3),
             _num(p.expected_speedup, 2, "×"), _num(p.measured_speedup, 2, "×"), _lossless_cell(p.lossless)]
            for name, sweep in [(f"{r.mode} (this report)", r.sweep)] + [(c.name, c.sweep) for c in r.comparisons]
            for p in sorted(sweep, key=lambda p: (p.temperature, p.k))
        ]
        sections.append(("Other drafts on the same prompts", [
            ("p", "Every draft decodes the same prompts with the same target, over the same k and temperatures. "
                  "The bigram baseline drafts the most frequent successor of each token in the training "
                  "features (no neural network; cost close to zero)."),
            ("table", ["draft", "k", "T", "τ", "α_j conditional", "c", "expected speedup", "measured speedup",
                       "lossless"], rows),
        ]))

    # Validation.
    blocks = [("p", "Teacher-forced loss and accuracy per unrolled step, computed by the runtime's target and head "
                    "on held-out sequences, next to the trainer's own validation numbers. "
                    f"Tolerance: {r.val_tolerance:g}.")]
    if r.val_mismatch:
        blocks.append(("flag", "MISMATCH: runtime and trainer validation differ by more than the tolerance "
                               f"{r.val_tolerance:g}."))
    else:
        blocks.append(("p", "Runtime and trainer validation agree within the tolerance."
                       if r.trainer_val_loss is not None or r.trainer_val_acc is not None
                       else "The trainer recorded no validation numbers to compare with."))

    def at(values: list[float] | None, j: int) -> float | None:
        return values[j] if values is not None and j < len(values) else None

    def diff(a: float | None, b: float | None) -> str:
        return "—" if a is None or b is None else _signed(a - b, 4)

    steps = max(len(r.val_loss), len(r.val_acc), len(r.trainer_val_loss or []), len(r.trainer_val_acc or []))
    rows = []
    for j in range(steps):
        loss, tloss = at(r.val_loss, j), at(r.trainer_val_loss, j)
        acc, tacc = at(r.val_acc, j), at(r.trainer_val_acc, j)
        rows.append([str(j), _num(loss, 4), _num(tloss, 4), diff(loss, tloss),
                     _num(acc, 4), _num(tacc, 4), diff(acc, tacc)])
    blocks.append(("table", ["step", "val loss (runtime)", "val loss (trainer)", "Δ loss",
                             "val acc (runtime)", "val acc (trainer)", "Δ acc"], rows))
    sections.append(("Validation per unrolled step", blocks))

    # Lossless.
    t0 = [p for p in r.sweep if p.lossless is not None]
    if r.lossless:
        blocks = [("p", f"Lossless: yes. At temperature 0 the speculative output was token-identical to the "
                        f"runtime's plain greedy output on every eval prompt ({len(t0)} sweep point(s) checked).")]
    else:
        blocks = [("flag", "Lossless: NO. Speculative output at temperature 0 differs from plain greedy decoding"
                           + (f": {r.lossless_detail}" if r.lossless_detail else "."))]
    sections.append(("Lossless check", blocks))

    # Baseline.
    if r.baseline is not None:
        b = r.baseline
        blocks = [("p", f"Baseline: {b.path}. Deltas are this report minus the baseline. A regression is a relative "
                        f"fall of more than {REL_DROP:.0%} in τ, expected speedup or validation accuracy, more than "
                        f"{REL_DROP_MEASURED:.0%} in measured speedup, a rise of more than {REL_RISE_LOSS:.0%} in "
                        "validation loss, lossless turning false or a new validation mismatch.")]
        if b.regressions:
            blocks += [("flag", f"REGRESSION: {line}") for line in b.regressions]
        else:
            blocks.append(("p", "No regressions against the baseline."))
        blocks += [("p", f"Note: {line}") for line in b.notes]
        blocks.append(("table", ["metric", "Δ (new − old)"],
                       [[name, _signed(d, 4)] for name, d in b.deltas.items()]))
        sections.append(("Baseline comparison", blocks))

    # Context.
    sections.append(("Settings, versions, device", [
        ("p", f"Device: {r.device}. Created: {r.created}. Report schema {r.schema_version}."),
        ("table", ["package", "version"], [[k, v] for k, v in sorted(r.versions.items())]),
        ("pre", json.dumps(r.settings, indent=2, sort_keys=True, default=str, ensure_ascii=False)),
    ]))
    return sections


def _title(report: Report) -> str:
    return f"Release report: {report.mode} draft (k={report.k}, T={report.temperature:g})"


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    """The report as Markdown (no plots; they are in the HTML)."""
    lines = [f"# {_title(report)}", ""]
    for title, blocks in _sections(report):
        lines += [f"## {title}", ""]
        for block in blocks:
            kind = block[0]
            if kind == "p":
                lines += [block[1], ""]
            elif kind == "flag":
                lines += [f"**{block[1]}**", ""]
            elif kind == "table":
                headers, rows = block[1], block[2]
                lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
                lines.append("|" + "|".join("---" for _ in headers) + "|")
                lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
                lines.append("")
            elif kind == "pre":
                fence = "````" if "```" in block[1] else "```"
                lines += [f"{fence}json", block[1], fence, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem; margin: 2rem auto;
       padding: 0 1rem; color: #1b1b1b; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.75rem 0; font-size: 0.92rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
.flag { background: #fde8e8; border-left: 4px solid #c81e1e; padding: 0.5rem 0.75rem; font-weight: 600; }
pre { background: #f6f6f6; padding: 0.75rem; overflow-x: auto; font-size: 0.85rem; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; }
figcaption { font-size: 0.85rem; color: #555; }
""".strip()


def render_html(report: Report, plots: dict[str, bytes] | None = None) -> str:
    """The report as one self-contained HTML page. ``plots`` defaults to :func:`eval.plots.render_plots`."""
    from eval.plots import PLOTS, render_plots

    if plots is None:
        plots = render_plots(report)
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{e(_title(report))}</title>", f"<style>\n{_CSS}\n</style>", "</head>", "<body>",
           f"<h1>{e(_title(report))}</h1>"]
    for title, blocks in _sections(report):
        out.append(f"<h2>{e(title)}</h2>")
        for block in blocks:
            kind = block[0]
            if kind == "p":
                out.append(f"<p>{e(block[1])}</p>")
            elif kind == "flag":
                out.append(f'<p class="flag">{e(block[1])}</p>')
            elif kind == "table":
                headers, rows = block[1], block[2]
                out.append("<table>")
                out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>")
                out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
                out.append("</table>")
            elif kind == "pre":
                out.append(f"<pre>{e(block[1])}</pre>")
            elif kind == "img":
                key = block[1]
                data = base64.b64encode(plots[key]).decode("ascii")
                out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{e(PLOTS[key])}">'
                           f"<figcaption>{e(PLOTS[key])}</figcaption></figure>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Writing


def write_report(report: Report, out_dir: Path, baseline: Path | None = None) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and ``report.html`` into ``out_dir``.

    With ``baseline`` (a report.json), load it and set ``report.baseline = compare(...)`` first; a bad
    baseline is a :class:`UserError` and nothing is written. Everything is rendered before the first file
    is written, and each file is replaced atomically.
    """
    if baseline is not None:
        report.baseline = compare(report, load_report(Path(baseline)), str(baseline))
    data = report.model_dump(mode="json")
    md = render_markdown(report)
    page = render_html(report)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / name for kind, name in FILES.items()}
    write_json_atomic(paths["json"], data)
    write_atomic(paths["md"], md)
    write_atomic(paths["html"], page)
    return paths
