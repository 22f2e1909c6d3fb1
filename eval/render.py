"""The release report rendered: Markdown, one self-contained HTML page, and the three files written.

``write_report`` writes ``report.json``, ``report.md`` and a self-contained ``report.html`` (inline CSS, four
PNG plots embedded as data URIs, no JavaScript). Everything is rendered in memory first and each file is
written atomically, so a failure leaves no partial file behind. The schema is :mod:`eval.report`'s.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from mtp_train.eval.diagnosis import diagnosis_blocks
from mtp_train.eval.engine_check import engine_check_blocks, engine_mal_cell
from mtp_train.eval.lossless import lossless_blocks
from mtp_train.eval.plots import PLOTS, bucket_order, render_plots
from mtp_train.eval.report import (
    FILES,
    REL_DROP,
    REL_DROP_MEASURED,
    REL_RISE_LOSS,
    TAU_CONVENTION,
    Report,
    Sample,
    compare,
    load_report,
)
from mtp_train.eval.step_costs import cost_blocks, cost_terms, speedup_note, verify_cell
from mtp_train.io import write_atomic, write_json_atomic

__all__ = ["keep_previous", "render_html", "render_markdown", "write_report"]


# One list of sections, two renderers (Markdown, HTML).
#
# A section is (title, blocks); a block is one of
#   ("p", text)                   a paragraph
#   ("flag", text)                a warning that must stand out (REGRESSION, MISMATCH, NOT LOSSLESS)
#   ("table", headers, rows)      a table of strings
#   ("pre", text)                 preformatted text (JSON when it starts with "{")
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


def sample_blocks(samples: list[Sample]) -> list[tuple]:
    """Each sample as a heading line and its prompt and reply as preformatted text."""
    blocks: list[tuple] = [("p", "A few eval prompts per prompt set, with the reply of the headline sweep point. "
                                 "“identical” means token-identical to plain decoding (checked at T=0 only).")]
    for i, s in enumerate(samples, 1):
        mark = {True: "identical to plain decoding", False: "DIFFERS from plain decoding",
                None: "not compared (T > 0)"}[s.identical_to_plain]
        blocks.append(("p", f"{i}. {s.prompt_set} / {s.category}: {mark}"))
        blocks.append(("pre", f"PROMPT\n{s.prompt}\n\nREPLY\n{s.reply}"))
    return blocks


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}" if math.isfinite(x) else str(x)


def _group_table(groups: dict[str, Any], order: list[str]) -> tuple:
    rows = [
        [n, str(g.num_prompts), _num(g.tau), _alphas(g.alpha), _num(g.distinct2, 3), _num(g.measured_speedup, 2, "×")]
        for n, g in ((n, groups[n]) for n in order)
    ]
    return ("table", ["group", "prompts", "τ", "α_j conditional (j = 1..k)", "distinct-2", "measured speedup"], rows)


def _sections(report: Report) -> list[tuple[str, list[tuple]]]:
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
    if r.lossless is False:
        blocks.append(("flag", f"NOT LOSSLESS: speculative decoding at T=0 failed the check "
                               f"({r.lossless_check or 'token identity with plain greedy decoding'})"
                               + (f": {r.lossless_detail}" if r.lossless_detail else "") + "."))
    blocks.append(("table", ["metric", "value"], [
        ["mode", r.mode],
        ["headline setting", setting],
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
    ]))
    note = speedup_note(r.sweep)
    if note is not None:
        blocks.append(("p", note))
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
         _num(p.verify_cost_ratio, 3), _num(p.expected_speedup, 2, "×"), _num(p.measured_speedup, 2, "×"),
         _num(p.distinct2, 3),
         _lossless_cell(p.lossless), str(p.num_prompts), str(p.num_steps), str(p.generated_tokens),
         "—" if p.engine_acceptance is None else _num(p.engine_acceptance.mean_acceptance_length)]
        for p in sorted(r.sweep, key=lambda p: (p.temperature, p.k))
    ]
    sections.append(("Sweep over k and temperature", [
        ("p", "Lossless is checked at T=0 only (n/a otherwise). Engine MAL is vLLM's mean acceptance length, "
              "1 + accepted / drafts over the steps that verified drafts, accepted counted before a stop token or "
              "the length limit cut the output: compare it, not τ, with what vLLM or SGLang print."),
        ("table", ["k", "T", "τ", "α_j conditional", "c", "v", "expected speedup", "measured speedup",
                   "distinct-2", "lossless", "prompts", "steps", "tokens", "engine MAL"], rows),
        ("img", "tau_by_k"),
    ]))
    if r.engine_checks:
        sections.append(("Served by an engine", engine_check_blocks(r)))
    sections.append(("Draft cost c and verify cost v: what they were computed from", cost_blocks(r)))

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

    sections.append(("Lossless check", lossless_blocks(r)))

    if r.samples:
        sections.append((f"Text samples ({setting})", sample_blocks(r.samples)))

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
                lines += [fence + ("json" if block[1].startswith("{") else "text"), block[1], fence, ""]
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


def keep_previous(out_dir: Path, created: str | None) -> Path:
    """Move the report files in ``out_dir`` into ``out_dir/previous/CREATED/`` and return that directory.

    ``created`` is the old report's creation time (``None`` when it could not be read: the file time is used).
    The files go into a hidden directory first, which is then renamed, so a half-moved report never shows.
    """
    out_dir = Path(out_dir)
    present = [out_dir / name for name in FILES.values() if (out_dir / name).is_file()]
    if created is None:
        from datetime import datetime, timezone

        created = datetime.fromtimestamp(present[0].stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    stamp = re.sub(r"[^0-9A-Za-z]", "", created.split("+")[0])  # 2026-12-01T08:00:00+00:00 -> 20261201T080000
    root = out_dir / "previous"
    root.mkdir(exist_ok=True)
    dest, n = root / stamp, 1
    while dest.exists():
        n += 1
        dest = root / f"{stamp}-{n}"
    staging = Path(tempfile.mkdtemp(prefix=".keep-", dir=root))
    for path in present:
        os.replace(path, staging / path.name)
    os.replace(staging, dest)
    return dest
