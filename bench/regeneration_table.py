"""Acceptance per prompt set for heads trained on different data, side by side, from their eval reports.

    .venv/bin/python bench/regeneration_table.py "SGD as written=runs/a/eval/report.json" \
        "SGD regenerated=runs/b/eval/report.json" "general regenerated=runs/c/eval/report.json"

For each report (the head's own sweep at T = 0): the runtime's validation top-1 at the first unrolled step,
then per prompt set α₁ (first-position acceptance at k = 1) and τ at each k, and Spec-Bench and MT-bench pooled
(by verify steps, exactly). The last column is α₁ minus the validation top-1: near 0 when the head is measured
on the distribution it was trained on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import measured_on  # noqa: E402
from mtp_train.eval.report import Group, Report, load_report  # noqa: E402

POOLED = ("spec_bench", "mt_bench")


def pool(groups: list[Group]) -> tuple[float, float]:
    """(α₁, τ) over several slices, weighted by their verify steps."""
    steps = sum(g.num_steps or 0 for g in groups)
    if not steps:
        raise SystemExit("a report without per-slice step counts: rerun its eval with this version")
    return (sum(g.alpha[0] * g.num_steps for g in groups) / steps,  # type: ignore[operator]
            sum(g.tau * g.num_steps for g in groups) / steps)  # type: ignore[operator]


def rows(label: str, report: Report) -> list[str]:
    points = {p.k: p for p in report.sweep if p.temperature == 0.0}
    if 1 not in points:
        raise SystemExit(f"{label}: the report has no k = 1 point at T = 0")
    ks = sorted(points)
    top1 = report.val_acc[0]
    sets = list(points[1].by_prompt_set)
    out = []
    for name in [*sets, "+".join(POOLED)]:
        if name in sets:
            a1 = points[1].by_prompt_set[name].alpha[0]
            taus = [points[k].by_prompt_set[name].tau for k in ks]
            n = points[1].by_prompt_set[name].num_prompts
        elif all(s in sets for s in POOLED):
            a1 = pool([points[1].by_prompt_set[s] for s in POOLED])[0]
            taus = [pool([points[k].by_prompt_set[s] for s in POOLED])[1] for k in ks]
            n = sum(points[1].by_prompt_set[s].num_prompts for s in POOLED)
        else:
            continue
        out.append(f"| {label} | {top1:.3f} | {name} ({n}) | {a1:.3f} | {' / '.join(f'{t:.3f}' for t in taus)} "
                   f"| {a1 - top1:+.3f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="LABEL=REPORT.json")
    args = parser.parse_args()
    print("| training data | val top-1 | prompt set (prompts) | α₁ (k = 1) | τ at k = 1 / 2 / 3 / 4 | α₁ − top-1 |")
    print("|---|---|---|---|---|---|")
    devices = {}
    for spec in args.reports:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"{spec}: give LABEL=REPORT.json")
        report = load_report(Path(path))
        devices[label] = report.device
        for line in rows(label, report):
            print(line)
    print("\n" + measured_on(devices))


if __name__ == "__main__":
    main()
