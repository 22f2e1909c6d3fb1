"""Draft trees against chains, and the expected speedup against the measured one, from eval reports.

    .venv/bin/python bench/tree_table.py "LABEL=runs/a/eval/report.json" ...

For each report, its own draft and every comparison draft (``eval.compare``), at each temperature:

1. every tree of ``eval.trees`` beside the chain of k = its depth: τ, their ratio (the goal is ≥ 1.15× at topk 4,
   depth 4, 8 draft tokens), SGLang's accept length for the same run, acceptance by depth, the draft and verify time
   per step, the expected and measured speedup, lossless;
2. the best tree's measured speedup beside the best chain's;
3. every point's expected speedup τ / (v + f·c), from costs measured apart from the speculative run's wall time
   (c: the timed draft forwards; v: the plain decode step with its forward widened to the verify's tokens, both
   in plain decode steps, the forwards probed at the run's batch sizes), against the measured one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import measured_on  # noqa: E402
from mtp_train.eval.report import SweepPoint, load_report  # noqa: E402


def _setting(p: SweepPoint) -> str:
    return f"tree {p.tree.describe()}" if p.tree is not None else f"chain k={p.k}"


def _best(points: list[SweepPoint]) -> SweepPoint:
    return max(points, key=lambda p: p.measured_speedup or 0.0)


def tables(label: str, name: str, chains: list[SweepPoint], trees: list[SweepPoint]) -> tuple[list[str], list[str],
                                                                                                  list[str]]:
    tree_rows, best, gaps = [], [], []
    for t in sorted({p.temperature for p in chains + trees}):
        chain_at = {p.k: p for p in chains if p.temperature == t}
        for p in (p for p in trees if p.temperature == t):
            chain = chain_at.get(p.k)
            mal = p.engine_acceptance.mean_acceptance_length if p.engine_acceptance else float("nan")
            draft = p.cost.draft_forward_ms * (p.draft_forwards_per_step or p.k) if p.cost else float("nan")
            tree_rows.append(
                f"| {label} | {name} | {p.tree.describe()} | {t:g} | {p.tau:.3f} | "
                + (f"{chain.tau:.3f} | {p.tau / chain.tau:.3f}×" if chain else "— | —")
                + f" | {mal:.3f} | {', '.join(f'{a:.2f}' for a in p.alpha)} | {draft:.1f} | "
                f"{p.cost.verify_step_ms:.1f} | {p.expected_speedup:.2f}× | {p.measured_speedup:.2f}× | "
                f"{'yes' if p.lossless else 'n/a' if p.lossless is None else 'NO'} |")
        here = [p for p in trees if p.temperature == t]
        if here and chain_at:
            tree, chain = _best(here), _best(list(chain_at.values()))
            best.append(f"| {label} | {name} | {t:g} | {tree.measured_speedup:.2f}× ({_setting(tree)}) | "
                        f"{chain.measured_speedup:.2f}× ({_setting(chain)}) |")
        for p in sorted((p for p in chains + trees if p.temperature == t), key=lambda p: (p.tree is not None, p.k)):
            gap = p.expected_speedup / p.measured_speedup - 1 if p.measured_speedup else float("nan")
            gaps.append(f"| {label} | {name} | {_setting(p)} | {t:g} | {p.verify_cost_ratio:.3f} | "
                        f"{(p.draft_forwards_per_step or p.k) * p.draft_cost_ratio:.3f} | {p.expected_speedup:.2f}× | "
                        f"{p.measured_speedup:.2f}× | {gap:+.0%} |")
    return tree_rows, best, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="LABEL=REPORT.json")
    args = parser.parse_args()
    rows: tuple[list[str], list[str], list[str]] = ([], [], [])
    devices = {}
    for item in args.reports:
        label, path = item.split("=", 1)
        report = load_report(Path(path))
        devices[label] = report.device
        drafts = [(report.mode, report.sweep, report.tree_sweep)]
        drafts += [(c.name, c.sweep, c.tree_sweep) for c in report.comparisons]
        for name, chains, trees in drafts:
            for into, part in zip(rows, tables(label, name, chains, trees)):
                into.extend(part)
    print("| target | draft | tree | T | τ | chain τ (k = depth) | tree / chain | SGLang accept length | α by depth | "
          "draft ms / step | verify ms / step | expected | measured | lossless |\n|" + "---|" * 14)
    print("\n".join(rows[0]))
    print("\n| target | draft | T | best tree | best chain |\n|---|---|---|---|---|")
    print("\n".join(rows[1]))
    print("\n| target | draft | setting | T | v | f·c | expected τ / (v + f·c) | measured | expected / measured "
          "- 1 |\n|" + "---|" * 9)
    print("\n".join(rows[2]))
    print("\n" + measured_on(devices))


if __name__ == "__main__":
    main()
