"""The release report's plots, rendered to PNG bytes: each answers one release question with every evaluated
draft on it (the report's own head and each ``eval.compare`` draft, one colour each), and with one panel per
temperature where the sweep has several, so that T = 0 and T = 1 are never read off one curve.

Matplotlib is imported only when a figure is drawn (:func:`_new_figure`), so importing the report module stays
cheap. The figures are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly: no pyplot, no
global backend switch, no figures left open, and no display needed. One function draws each plot.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mtp_train.eval.report import Group, Report, SweepPoint

# Keys of the dicts figures and render_plots return, in the order the report shows them, with their captions.
PLOTS: dict[str, str] = {
    "alpha": "α by draft position at the deepest k, every draft: conditional (solid) and unconditional (dashed)",
    "tau_by_k": "τ (solid) and the engines' mean acceptance length (dotted) by k, every draft; plain decoding is 1",
    "speedup_by_k": "measured speedup (solid) and the expected speedup predicted from τ, c and v (dashed) by k, "
                    "every draft; below 1× speculation is slower than plain decoding",
    "tau_by_group": "τ by prompt set and by prompt category, every draft, at the headline k and T",
    "tau_by_length": "τ (left) and the draft cost ratio c (right) by context-length bucket, every draft, at the "
                     "headline k and T (c: one draft forward over one plain decode step, batch 1, at the bucket's "
                     "median prompt)",
    "training": "τ (left) and α₁ (right) of the held-out probe prompts against training tokens, every head trained "
                "with train.tau_every (T = 0, the recipe's largest k)",
}

_TAU_CONVENTION = "τ: tokens per target step, bonus included"


def bucket_order(name: str) -> tuple[float, str]:
    """Sort context-length buckets such as "0-127", "128-511", "512+" by their lower bound."""
    m = re.match(r"\s*(\d+)", name)
    return (float(m.group(1)) if m else float("inf"), name)


def _temp_label(t: float) -> str:
    return f"T={t:g}"


def drafts(report: Report) -> list[tuple[str, list[SweepPoint]]]:
    """Every evaluated draft and its chain sweep: the report's own first, then its comparisons."""
    return [(report.mode, report.sweep)] + [(c.name, c.sweep) for c in report.comparisons]


def figures(report: Report) -> dict[str, Figure]:
    """The report's plots as matplotlib figures, keyed as in :data:`PLOTS`."""
    return {"alpha": alpha_plot(report), "tau_by_k": tau_by_k_plot(report), "speedup_by_k": speedup_plot(report),
            "tau_by_group": tau_by_group_plot(report), "tau_by_length": tau_by_length_plot(report),
            "training": training_plot(report)}


def render_plots(report: Report) -> dict[str, bytes]:
    """Return the report's plots as PNG bytes, keyed as in :data:`PLOTS`."""
    return {key: _png(fig) for key, fig in figures(report).items()}


def _new_figure(panels: int):
    """A figure of the report's size (wider per panel) on the Agg canvas, and its ``panels`` axes side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.4 + 3.6 * panels, 3.9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, list(axes)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _legend(fig: Figure) -> None:
    """One legend for the whole figure, right of its panels, with every label any panel drew (once each)."""
    handles: dict[str, object] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize="small")


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this report", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _temperatures(report: Report) -> list[float]:
    return sorted({p.temperature for _, sweep in drafts(report) for p in sweep}) or [report.temperature]


def _color(i: int) -> str:
    return f"C{i % 10}"


def _per_temperature(report: Report, draw, title: str, ylabel: str, what: str) -> Figure:
    """One panel per temperature; ``draw(ax, i, name, points)`` draws draft ``i``'s points at that temperature
    (sorted by k) and returns whether it drew anything."""
    temps = _temperatures(report)
    fig, axes = _new_figure(len(temps))
    for ax, t in zip(axes, temps):
        drew = False
        for i, (name, sweep) in enumerate(drafts(report)):
            points = sorted((p for p in sweep if p.temperature == t), key=lambda p: p.k)
            if points and draw(ax, i, name, points):
                drew = True
        if not drew:
            _no_data(ax, what)
        ax.set_title(f"{title}, {_temp_label(t)}")
        ax.set_ylabel(ylabel)
    _legend(fig)
    return fig


def alpha_plot(report: Report) -> Figure:
    """α by position at the deepest k each draft was swept to, conditional and unconditional, every draft."""
    def draw(ax, i, name, points) -> bool:
        p = points[-1]
        if not (p.alpha or p.alpha_unconditional):
            return False
        if p.alpha:
            ax.plot(range(1, len(p.alpha) + 1), p.alpha, marker="o", color=_color(i), label=f"{name} conditional")
        if p.alpha_unconditional:
            ax.plot(range(1, len(p.alpha_unconditional) + 1), p.alpha_unconditional, marker="s", linestyle="--",
                    color=_color(i), label=f"{name} unconditional")
        ax.set_xticks(range(1, max(len(p.alpha), len(p.alpha_unconditional)) + 1))
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(f"draft position j (k={p.k})")
        return True

    return _per_temperature(report, draw, "α by position", "acceptance rate α_j", "α values")


def tau_by_k_plot(report: Report) -> Figure:
    """τ and the engines' mean acceptance length by k, every draft."""
    def draw(ax, i, name, points) -> bool:
        ks = [p.k for p in points]
        ax.plot(ks, [p.tau for p in points], marker="o", color=_color(i), label=f"{name} τ")
        mal = [(p.k, p.engine_acceptance.mean_acceptance_length) for p in points if p.engine_acceptance is not None]
        if mal:
            ax.plot(*zip(*mal), marker="x", linestyle=":", color=_color(i), label=f"{name} engine MAL")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(ks)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("draft length k")
        return True

    return _per_temperature(report, draw, "τ by k", _TAU_CONVENTION, "sweep points")


def speedup_plot(report: Report) -> Figure:
    """Measured speedup by k beside the expected one, every draft, and the 1× line of plain decoding."""
    def draw(ax, i, name, points) -> bool:
        ks = [p.k for p in points]
        measured = [(p.k, p.measured_speedup) for p in points if p.measured_speedup is not None]
        if measured:
            ax.plot(*zip(*measured), marker="o", color=_color(i), label=f"{name} measured")
        ax.plot(ks, [p.expected_speedup for p in points], marker="^", linestyle="--", color=_color(i),
                label=f"{name} expected")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(ks)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("draft length k")
        return True

    return _per_temperature(report, draw, "speedup by k", "speedup over plain decoding (×)", "sweep points")


def headline_groups(report: Report, field: str) -> list[tuple[str, dict[str, Group]]]:
    """Each draft's groups (``by_prompt_set`` or ``by_category``) at the headline k and T."""
    out = []
    for name, sweep in drafts(report):
        point = next((p for p in sweep if p.k == report.k and p.temperature == report.temperature), None)
        groups = getattr(point, field) if point is not None else {}
        if not groups and name == report.mode:
            groups = getattr(report, field)
        out.append((name, groups))
    return out


def _grouped_bars(ax, series: list[tuple[str, dict[str, Group]]], order: list[str], xlabel: str) -> None:
    """Bars of τ per group (x) and draft (colour), with the plain-decoding line."""
    if not order:
        _no_data(ax, "groups")
        return
    width = 0.8 / max(1, len(series))
    for i, (name, groups) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(order)) if order[g] in groups]
        taus = [groups[n].tau for n in order if n in groups]
        ax.bar(xs, taus, width=width, color=_color(i), label=name)
    crowded = len(order) > 5
    ax.set_xticks(range(len(order)), order, rotation=30 if crowded else 0, ha="right" if crowded else "center",
                  fontsize="small")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(_TAU_CONVENTION)


def tau_by_group_plot(report: Report) -> Figure:
    """τ by prompt set (left) and by prompt category (right), every draft, at the headline setting."""
    fig, (sets_ax, cats_ax) = _new_figure(2)
    for ax, field, xlabel in ((sets_ax, "by_prompt_set", "prompt set"), (cats_ax, "by_category", "category")):
        series = headline_groups(report, field)
        order = sorted({n for _, groups in series for n in groups})
        _grouped_bars(ax, series, order, xlabel)
        ax.set_title(f"τ by {xlabel} (k={report.k}, {_temp_label(report.temperature)})")
    _legend(fig)
    return fig


def tau_by_length_plot(report: Report) -> Figure:
    """τ (bars) and c (lines) by context-length bucket at the headline setting, buckets in length order, every
    draft; a draft without c by bucket (a report that predates it) has no line."""
    fig, (ax, right) = _new_figure(2)
    series = headline_groups(report, "by_length")
    order = sorted({n for _, groups in series for n in groups}, key=bucket_order)
    _grouped_bars(ax, series, order, "context length (tokens)")
    ax.set_title(f"τ by context length (k={report.k}, {_temp_label(report.temperature)})")
    drawn = False
    for i, (name, groups) in enumerate(series):
        xs = [x for x, n in enumerate(order) if n in groups and groups[n].draft_cost_ratio is not None]
        if xs:
            right.plot(xs, [groups[order[x]].draft_cost_ratio for x in xs], marker="o", color=_color(i))
            drawn = True
    if drawn:
        right.set_xticks(range(len(order)), order, rotation=30, ha="right")
        right.set_xlabel("context length (tokens)")
        right.set_ylabel("c (draft forward / plain decode step)")
        right.set_ylim(bottom=0)
        right.set_title("draft cost c by context length")
    else:
        _no_data(right, "c by context length")
    _legend(fig)
    return fig


def training_plot(report: Report) -> Figure:
    """τ and α₁ of each head's probes while it trained, against its training tokens (log scale)."""
    fig, (left, right) = _new_figure(2)
    for ax, field, label in ((left, "tau", _TAU_CONVENTION), (right, "alpha1", "α₁ (first draft position)")):
        for i, (name, points) in enumerate(report.training.items()):
            ax.plot([p.train_tokens for p in points], [getattr(p, field) for p in points], marker="o",
                    color=_color(i), label=name)
        if report.training:
            ax.set_xscale("log")
            ax.set_xlabel("training tokens")
            ax.set_ylabel(label)
        else:
            _no_data(ax, "τ probes (train.tau_every)")
    _legend(fig)
    return fig
