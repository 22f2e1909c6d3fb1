"""Ours at one point of bench/peer_sweep.py's grid with overrides of any recipe field, trained and scored as the sweep
scores it (SGD as written, scale 1, seed 0; vLLM's mean acceptance length at k = 3 on the 16 validation prompts): what
a setting is worth to our trainer beside the sweep's grid, one seed, for choosing what to measure next. It makes no
claim against a peer.

    make smollm2 vllm
    .venv/bin/python bench/peer_probe.py "train.lr=1e-2;train.unroll=2;train.optimizer=muon" [more sets...]

Each argument is one run's overrides joined by ";". Runs go to runs/peers/probe/ (its conversations are the sweep's),
each trained once per overrides; one JSON line per run: the overrides, MAL and α₁ at k = 3, whether vLLM's output
equalled its plain output, and our training tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

import peer_parity as pp  # noqa: E402
import peer_runs as pr  # noqa: E402
import peer_sweep as ps  # noqa: E402
from peer_table import pooled  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="one run's overrides joined by ';'")
    parser.add_argument("--rows", type=int, default=80, help="conversations trained on (the sweep's)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (the sweep's)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers" / "probe")
    args = parser.parse_args(argv)
    if not pr.VLLM_PYTHON.is_file():
        sys.exit(f"peer_probe: {pr.VLLM_PYTHON} not found; run `make vllm` first")
    print(machine_line(), flush=True)
    cell = args.work.resolve()
    cell.mkdir(parents=True, exist_ok=True)
    (cell / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in pp.conversations("sgd", args.rows)))
    recipe = pr.base_recipe()
    job = pp.scoring_job(recipe, ps.validation_prompts(args.rows * 4, 16), 48, ps.K)
    plain = functools.cache(lambda: pp.served({**job, "head": None}, cell, "vllm-plain"))
    trainers = pp.Trainers(cell, args.steps, 0, recipe, 2)
    for run in args.runs:
        overrides = run.split(";")
        cost, head = trainers.ours(overrides)
        by_set = pp.score(cell, job, plain(), [ps.K], head)[ps.K]
        a = pooled([r["counts"] for r in by_set.values()])
        print(json.dumps({"overrides": overrides, "mal": round(a.mal, 4), "alpha1": round(a.alphas[0], 4),
                          "lossless": all(r["lossless"] for r in by_set.values()),
                          "tokens_per_s": round(cost["tokens_per_s"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
