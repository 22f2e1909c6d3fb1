"""Training tokens/s like for like: ours, ours with the exact teacher, SpecForge 0.2.0 and speculators 0.9.0 on one
cell's token ids and loss masks, at the same settings, steps and tokens per step, side by side in one run.

    make smollm2 peers speculators
    .venv/bin/python bench/peer_speed.py [--data sgd] [--rows 80] [--steps 30] [--ttt 2 7]

Every trainer gets the same work: our draft vocabulary, lr and warm-up (bench/peer_parity.py's ``matched`` row), the
TTT length of the line (``--ttt``; ours: ``train.unroll``), as many optimizer steps as ours takes, each carrying our
mean tokens per step, one loader thread, 2 torch threads. ``ours`` reads its stored top-32 teacher; ``ours-exact``
computes the full-vocabulary teacher in the step from the stored last state, as both peers do (``train.teacher:
exact``, no top-K stored). Tokens/s is Σ tokens / Σ optimizer-step wall time on every side (waiting for the batch
included: SpecForge's controller times the whole fit-loop window, speculators' profile times from one step's end to
the next's); SpecForge's compute-only time (its ``perf/train_compute_time_s``) is printed beside. Acceptance is
bench/peer_parity.py's business; this only times. Runs in ``WORK/speed-DATA`` from scratch each time; prints the
table and the ratios of each side of ours to each peer. Run it alone: the cores are what it measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

import peer_parity as pp  # noqa: E402
import peer_runs as pr  # noqa: E402


def line(cell: Path, recipe: dict, ttt: int, steps: int, threads: int, peers: list[str]) -> dict[str, dict]:
    """Each trainer's cost (bench/peer_runs.py's result: steps, tokens_trained, tokens_per_s, ...) at TTT ``ttt``."""
    matched = pp.settings_rows(recipe, pr.RESULTS)["matched"][1]
    unroll = [f"train.unroll={ttt}"]
    ours = pr.train_ours(cell, steps, unroll, 0, f"ours-ttt{ttt}")
    costs = {"ours": ours, "ours-exact": pr.train_ours(cell, steps, unroll + pp.EXACT, 0, f"ours-exact-ttt{ttt}")}
    for peer in peers:
        settings = pr.with_point(peer, matched[peer], recipe["train"]["lr"], ttt)
        job = pr.peer_job(peer, cell, f"ours-ttt{ttt}", ours, recipe, settings, threads, 0, f"{peer}-ttt{ttt}")
        costs[peer] = pr.train_peer(peer, job, cell, f"{peer}-ttt{ttt}")
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("sgd",), default="sgd", help="the cell's conversations (SGD as written)")
    parser.add_argument("--rows", type=int, default=80, help="conversations (bench/peer_parity.py's scale 1)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps, every trainer")
    parser.add_argument("--ttt", type=int, nargs="+", default=[2, 7], help="TTT lengths, one line each")
    parser.add_argument("--threads", type=int, default=2, help="the peers' torch threads (ours: the recipe's)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--peers", nargs="+", default=list(pp.PEERS), choices=list(pp.PEERS))
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    for python, make in [pr.RUNNERS[peer] for peer in args.peers]:
        if not python.is_file():
            sys.exit(f"peer_speed: {python} not found; run `make {make}` first")
    recipe = pr.base_recipe()
    cell = args.work.resolve() / f"speed-{args.data}"
    pr.fresh(cell, {"rows": args.rows}, reuse=False)
    (cell / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in pp.conversations(args.data,
                                                                                                     args.rows)))
    lines = {ttt: line(cell, recipe, ttt, args.steps, args.threads, args.peers) for ttt in args.ttt}
    print("\n| TTT | trainer | steps | tokens trained | tokens/s | compute-only tokens/s | feature bytes/token |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for ttt, costs in lines.items():
        for trainer, c in costs.items():
            compute = f"{c['compute_tokens_per_s']:,.0f}" if c.get("compute_tokens_per_s") else "–"
            print(f"| {ttt} | {trainer} | {c['steps']} | {c['tokens_trained']:,} | {c['tokens_per_s']:,.0f} | "
                  f"{compute} | {c['bytes_per_token']:,.0f} |")
    print()
    for ttt, costs in lines.items():
        for peer in args.peers:
            ratios = ", ".join(f"{ours} {costs[ours]['tokens_per_s'] / costs[peer]['tokens_per_s']:.2f}×"
                               for ours in ("ours", "ours-exact"))
            print(f"- TTT {ttt}, tokens/s ÷ {peer}: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
