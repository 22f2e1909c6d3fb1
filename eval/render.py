"""The release report rendered: Markdown, one self-contained HTML page, and the three files written.

``write_report`` writes ``report.json``, ``report.md``, a self-contained ``report.html`` (inline CSS, the PNG plots
embedded as data URIs, no JavaScript) and ``model_card.md``, the block both pages start with
(:mod:`mtp_train.eval.model_card`). Everything is rendered in memory first and each file is written atomically,
so a failure leaves no partial file behind. The schema is :mod:`mtp_train.eval.report`'s; the
sections both renderers show, and the blocks they are made of, are :mod:`mtp_train.eval.sections`'.
"""

from __future__ import annotations

import base64
import html
import os
import re
import tempfile
from pathlib import Path

from mtp_train.eval.model_card import card_markdown
from mtp_train.eval.plots import PLOTS, render_plots
from mtp_train.eval.report import FILES, Report, compare, load_report
from mtp_train.eval.sections import sections
from mtp_train.io import write_atomic, write_json_atomic

__all__ = ["keep_previous", "render_html", "render_markdown", "write_report"]


def _title(report: Report) -> str:
    return f"Release report: {report.mode} draft (k={report.k}, T={report.temperature:g})"


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    """The report as Markdown (no plots; they are in the HTML)."""
    lines = [f"# {_title(report)}", "", card_markdown(report)]
    for title, blocks in sections(report):
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
pre.card { white-space: pre-wrap; overflow-wrap: anywhere; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; }
figcaption { font-size: 0.85rem; color: #555; }
""".strip()


def render_html(report: Report, plots: dict[str, bytes] | None = None) -> str:
    """The report as one self-contained HTML page. ``plots`` defaults to :func:`mtp_train.eval.plots.render_plots`."""
    if plots is None:
        plots = render_plots(report)
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{e(_title(report))}</title>", f"<style>\n{_CSS}\n</style>", "</head>", "<body>",
           f"<h1>{e(_title(report))}</h1>", "<h2>Model card</h2>",
           "<p>The block below is Markdown, to paste into the head's model card (also in model_card.md).</p>",
           f'<pre class="card">{e(card_markdown(report))}</pre>']
    for title, blocks in sections(report):
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
    card = card_markdown(report)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / name for kind, name in FILES.items()}
    write_json_atomic(paths["json"], data)
    write_atomic(paths["md"], md)
    write_atomic(paths["html"], page)
    write_atomic(paths["card"], card)
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
