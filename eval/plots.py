"""The four plots of the release report, rendered to PNG bytes.

Matplotlib is imported only when a figure is drawn (:func:`_new_axes`), so importing the report module stays
cheap. The figures are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly: no pyplot, no
global backend switch, no figures left open, and no display needed. One function draws each plot.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtp_train.eval.report import Group, Report

# Keys of the dict render_plots returns, in the order the report shows them, with their captions.
PLOTS: dict[str, str] = {
    "alpha": "α by draft position (conditional and unconditional), headline k",
    "tau_by_k": "τ by k, one line per temperature",
    "tau_by_category": "τ by prompt category, headline setting",
    "tau_by_length": "τ by context-length bucket, headline setting",
}

_TAU_CONVENTION = "τ: tokens per target step, bonus included"


def bucket_order(name: str) -> tuple[float, str]:
    """Sort context-length buckets such as "0-127", "128-511", "512+" by their lower bound."""
    m = re.match(r"\s*(\d+)", name)
    return (float(m.group(1)) if m else float("inf"), name)


def _temp_label(t: float) -> str:
    return f"T={t:g}"


def render_plots(report: Report) -> dict[str, bytes]:
    """Return the report's four plots as PNG bytes, keyed as in :data:`PLOTS`."""
    return {"alpha": alpha_plot(report), "tau_by_k": tau_by_k_plot(report),
            "tau_by_category": tau_by_category_plot(report), "tau_by_length": tau_by_length_plot(report)}


def _new_axes():
    """A figure of the report's size on the Agg canvas, and its one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this report", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _plain_line(ax) -> None:
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="plain decoding (τ = 1)")


def alpha_plot(report: Report) -> bytes:
    """α by position, conditional and unconditional, one colour per temperature, for the headline k."""
    fig, ax = _new_axes()
    series = [(p.temperature, p.alpha, p.alpha_unconditional) for p in report.sweep if p.k == report.k]
    series.sort(key=lambda s: s[0])
    if not series and (report.alpha or report.alpha_unconditional):
        series = [(report.temperature, report.alpha, report.alpha_unconditional)]
    if series:
        colors = [f"C{i % 10}" for i in range(len(series))]
        for color, (t, cond, uncond) in zip(colors, series):
            if cond:
                ax.plot(range(1, len(cond) + 1), cond, marker="o", color=color, label=f"{_temp_label(t)} conditional")
            if uncond:
                ax.plot(range(1, len(uncond) + 1), uncond, marker="s", linestyle="--", color=color,
                        label=f"{_temp_label(t)} unconditional")
        ax.set_xticks(range(1, max(max(len(s[1]), len(s[2])) for s in series) + 1))
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize="small")
    else:
        _no_data(ax, "α values")
    ax.set_xlabel("draft position j")
    ax.set_ylabel("acceptance rate α_j")
    ax.set_title(f"α by position (k={report.k})")
    return _png(fig)


def tau_by_k_plot(report: Report) -> bytes:
    """τ by k, one line per temperature."""
    fig, ax = _new_axes()
    if report.sweep:
        for t in sorted({p.temperature for p in report.sweep}):
            pts = sorted((p.k, p.tau) for p in report.sweep if p.temperature == t)
            ax.plot([k for k, _ in pts], [tau for _, tau in pts], marker="o", label=_temp_label(t))
        ks = sorted({p.k for p in report.sweep})
        ax.set_xticks(ks)
        _plain_line(ax)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    else:
        _no_data(ax, "sweep points")
    ax.set_xlabel("draft length k")
    ax.set_ylabel(_TAU_CONVENTION)
    ax.set_title("τ by k")
    return _png(fig)


def tau_by_category_plot(report: Report) -> bytes:
    """τ by prompt category at the headline setting."""
    names = sorted(report.by_category)
    return _group_bars(report, report.by_category, names, "τ by prompt category", "category")


def tau_by_length_plot(report: Report) -> bytes:
    """τ by context-length bucket at the headline setting, buckets in length order."""
    names = sorted(report.by_length, key=bucket_order)
    return _group_bars(report, report.by_length, names, "τ by context length", "context length (tokens)")


def _group_bars(report: Report, groups: dict[str, Group], names: list[str], title: str, xlabel: str) -> bytes:
    """One bar per group (τ, with its number of prompts) in the order of ``names``, at the headline setting."""
    fig, ax = _new_axes()
    if names:
        taus = [groups[n].tau for n in names]
        bars = ax.bar(range(len(names)), taus, color="C0")
        ax.bar_label(bars, labels=[f"{t:.2f}\n(n={groups[n].num_prompts})" for n, t in zip(names, taus)],
                     fontsize="small")
        crowded = len(names) > 6
        ax.set_xticks(range(len(names)), names, rotation=30 if crowded else 0, ha="right" if crowded else "center")
        _plain_line(ax)
        ax.set_ylim(0, max([*taus, 1.0]) * 1.25)
        ax.legend(fontsize="small", loc="lower right")
    else:
        _no_data(ax, "groups")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(_TAU_CONVENTION)
    ax.set_title(f"{title} (k={report.k}, {_temp_label(report.temperature)})")
    return _png(fig)
