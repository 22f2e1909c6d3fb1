"""α₁ by context length from eval reports: issue #50's goals read off ``report.json`` files.

    .venv/bin/python bench/length_table.py runs/smollm2-long/eval/report.json [more reports...]

For each report, from its k = 1 chain at T = 0: α₁ pooled over the length buckets under 1k tokens, at the long set's
4k size (bucket 2048-4095) and 8k size (4096-8191), both of those together, their ratio to under 1k, and α₁ pooled
over Spec-Bench and MT-bench (the short sets two recipes share; their held-out rows differ). Each α₁ is accepted
first drafts over verify steps, ± its binomial standard error over those steps (prompts are few: read it as a
lower bound of the error). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtp_train.errors import UserError  # noqa: E402
from mtp_train.eval.report import Group, load_report  # noqa: E402

GROUPS = {"under 1k": ("0-127", "128-511", "512-1023"), "4k size": ("2048-4095",), "8k size": ("4096-8191",),
          "4-8k": ("2048-4095", "4096-8191")}
SHORT_SETS = ("spec_bench", "mt_bench")


def pooled(groups: list[Group]) -> tuple[float, float, int] | None:
    """α₁ over ``groups``, weighted by verify steps; its SE."""
    steps = sum(g.num_steps for g in groups)
    if steps == 0:
        return None
    a = sum(g.alpha[0] * g.num_steps for g in groups) / steps
    return a, math.sqrt(a * (1 - a) / steps), steps


def row(path: Path) -> list[str]:
    report = load_report(path)
    chain = next((p for p in report.sweep if p.k == 1 and p.temperature == 0.0 and p.tree is None), None)
    if chain is None:
        raise UserError(f"{path}: no k = 1 chain at T = 0 in its sweep; evaluate with 1 in eval.k")
    by_length, by_set = chain.by_length, chain.by_prompt_set
    if any(g.num_steps is None for g in [*by_length.values(), *by_set.values()]):
        raise UserError(f"{path}: its groups predate their verify-step counts (num_steps); evaluate the head again")
    cells = {name: pooled([by_length[b] for b in buckets if b in by_length]) for name, buckets in GROUPS.items()}
    cells["short"] = pooled([by_set[s] for s in SHORT_SETS if s in by_set])
    ratio = (f"{cells['4-8k'][0] / cells['under 1k'][0]:.2f}" if cells["4-8k"] and cells["under 1k"] else "—")
    fmt = [f"{c[0]:.3f} ± {c[1]:.3f} ({c[2]})" if c else "—" for c in cells.values()]
    return [str(path), *fmt[:4], ratio, fmt[4]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        rows = [row(path) for path in args.reports]
    except UserError as e:
        print(f"length_table: {e}", file=sys.stderr)
        return 2
    print("| report | α₁ under 1k (steps) | 4k size | 8k size | 4-8k | 4-8k / under 1k | Spec-Bench + MT-bench |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
