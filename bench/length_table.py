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
import json
import math
import sys
from pathlib import Path

GROUPS = {"under 1k": ("0-127", "128-511", "512-1023"), "4k size": ("2048-4095",), "8k size": ("4096-8191",),
          "4-8k": ("2048-4095", "4096-8191")}
SHORT_SETS = ("spec_bench", "mt_bench")


def pooled(groups: list[dict]) -> tuple[float, float, int] | None:
    """α₁ over ``groups`` (report entries with ``alpha`` and ``num_steps``), weighted by verify steps; its SE."""
    steps = sum(g["num_steps"] for g in groups)
    if steps == 0:
        return None
    a = sum(g["alpha"][0] * g["num_steps"] for g in groups) / steps
    return a, math.sqrt(a * (1 - a) / steps), steps


class BadReport(Exception):
    """A path that holds no readable eval report with a k = 1 chain."""


def row(path: Path) -> list[str]:
    try:
        report = json.loads(path.read_text())
        chain = next(s for s in report["sweep"] if s["k"] == 1 and s["temperature"] == 0.0 and not s.get("tree"))
        by_length, by_set = chain["by_length"], chain["by_prompt_set"]
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise BadReport(f"{path}: not an eval report with a k = 1 chain at T = 0 ({type(e).__name__}); pass "
                        "OUTPUT_DIR/eval/report.json of an eval with 1 in eval.k") from e
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
    except BadReport as e:
        print(f"length_table: {e}", file=sys.stderr)
        return 2
    print("| report | α₁ under 1k (steps) | 4k size | 8k size | 4-8k | 4-8k / under 1k | Spec-Bench + MT-bench |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
