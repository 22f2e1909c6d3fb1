"""Print the eval headline table (every draft, k and temperature) of a report as Markdown.

    .venv/bin/python bench/eval_headline.py runs/tiny/eval/report.json

The rows come straight from the report that ``mtp-train recipes/tiny.yaml`` wrote: the trained head
(the report's own sweep) and each comparison draft (other head kinds, the bigram baseline), with tau
(bonus token included), alpha per position, the draft cost ratio c, the verify cost ratio v, the expected speedup tau / (v + k c)
and the measured wall-clock speedup against plain decoding in the same runtime, same prompts and batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> None:
    report = json.loads(Path(path).read_text())
    drafts = [(report["mode"], report["sweep"])] + [(c["name"], c["sweep"]) for c in report.get("comparisons", [])]
    print(f"report: {path} ({report['settings']['num_prompts']} prompts: "
          f"{', '.join(report['settings']['eval']['prompt_sets'])}; device {report['device']})")
    lossless = "n/a" if report["lossless"] is None else str(report["lossless"]).lower()
    print(f"lossless: {lossless}; validation per unrolled step (runtime / trainer): "
          f"loss {report['val_loss']} / {report['trainer_val_loss']}, top-1 {report['val_acc']} / {report['trainer_val_acc']}")
    print()
    print("| draft | k | T | τ | α_j (conditional) | c | v | expected speedup | measured speedup | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, sweep in drafts:
        for p in sorted(sweep, key=lambda p: (p["temperature"], p["k"])):
            lossless = "n/a" if p["lossless"] is None else str(p["lossless"]).lower()
            v = "—" if p.get("verify_cost_ratio") is None else f"{p['verify_cost_ratio']:.3f}"  # (older reports)
            print(f"| {name} | {p['k']} | {p['temperature']:g} | {p['tau']:.3f} | "
                  f"{', '.join(f'{a:.3f}' for a in p['alpha'])} | {p['draft_cost_ratio']:.3f} | {v} | "
                  f"{p['expected_speedup']:.2f}× | {p['measured_speedup']:.2f}× | {lossless} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/eval/report.json")
