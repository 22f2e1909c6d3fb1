"""τ, draft cost and measured speedup per draft and k at T = 0, side by side, from eval reports.

    .venv/bin/python bench/head_table.py "LABEL=runs/a/eval/report.json" "LABEL=runs/b/eval/report.json" ...

For each report, its own draft and every comparison draft (``eval.compare``) at T = 0: τ at each k, the draft cost
ratio c (one batched draft forward over one plain decode step, at the smallest k), the draft's cost per step at the
largest k (f·c: a chain's k forwards, a block draft's 2, each c at that k), and the measured speedup (plain wall
time over speculative wall time, same prompts, same run) at each k. LABEL names what the report varies (e.g. the
draft vocabulary); a draft named in several reports appears once per report, and a k a report did not sweep
shows as a dash.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import measured_on  # noqa: E402
from mtp_train.eval.report import SweepPoint, load_report  # noqa: E402


def row(label: str, name: str, sweep: list[SweepPoint], ks: list[int]) -> str:
    points = {p.k: p for p in sweep if p.temperature == 0.0}
    taus = " | ".join(f"{points[k].tau:.3f}" if k in points else "—" for k in ks)
    speedups = " | ".join(f"{points[k].measured_speedup:.2f}×" if k in points and points[k].measured_speedup
                          is not None else "—" for k in ks)
    c = points[min(points)].draft_cost_ratio
    last = points[max(points)]
    per_step = (last.draft_forwards_per_step or last.k) * last.draft_cost_ratio
    return f"| {name} | {label} | {c:.3f} | {per_step:.3f} (k={last.k}) | {taus} | {speedups} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="LABEL=REPORT.json")
    args = parser.parse_args()
    drafts, devices = [], {}
    for item in args.reports:
        label, _, path = item.partition("=")
        report = load_report(Path(path))
        devices[label] = report.device
        drafts += [(label, name, sweep) for name, sweep in
                   [(report.mode, report.sweep)] + [(c.name, c.sweep) for c in report.comparisons]]
    ks = sorted({p.k for _, _, sweep in drafts for p in sweep if p.temperature == 0.0})
    k_cols = " | ".join(f"τ k={k}" for k in ks) + " | " + " | ".join(f"speedup k={k}" for k in ks)
    print(f"| draft | vocabulary | c (k={ks[0]}) | draft per step, f·c | {k_cols} |")
    print("|---|---|---:|---:|" + "---:|" * (2 * len(ks)))
    print("\n".join(row(label, name, sweep, ks) for label, name, sweep in drafts))
    print("\n" + measured_on(devices))


if __name__ == "__main__":
    main()
