"""Why one bench/peer_parity.py cell came out as it did: ours again with SpecForge's loss-mask gate
(``train.mask_gate: input``), served by vLLM at one k on the cell's prompt sets beside the cell's pair of heads.

    .venv/bin/python bench/peer_parity.py                      # first: the cell and its heads at each seed
    .venv/bin/python bench/peer_ablation.py [--data sgd] [--scale 1] [--seed 0] [--k 3]

Give it the --work, --rows, --steps, --prompts, --new-tokens and --regen-rows peer_parity ran with (the defaults
match). The variant trains in WORK/ablation/CELL-ours-gate-input on the cell's conversations, at the cell's seed.
Prints α_1 and MAL ± SE per head and prompt set. (The spread over training seeds is peer_parity's own now: it
trains both sides at every seed of ``--seeds``.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

import peer_parity as pp  # noqa: E402
import peer_runs as pr  # noqa: E402
from peer_table import from_counts  # noqa: E402


def variant_cell(work: Path, cell: Path, name: str) -> Path:
    """WORK/ablation/CELL-NAME, emptied (a rerun trains afresh), holding the cell's conversations."""
    out = work / "ablation" / f"{cell.name}-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copyfile(cell / "conversations.jsonl", out / "conversations.jsonl")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("dolly", "sgd"), default="sgd")
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the cell's training seed")
    parser.add_argument("--setting", choices=("defaults", "matched", "tuned"), default="defaults",
                        help="the row of peer_parity whose SpecForge head stands beside")
    parser.add_argument("--peer", choices=list(pp.PEERS), default="specforge")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-k", type=int, default=3, help="peer_parity's largest k (it sizes vLLM's context)")
    parser.add_argument("--rows", type=int, default=80)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--regen-rows", type=int, default=320, help="peer_parity's: rows × its largest scale")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    work = args.work.resolve()
    cell = work / f"{args.data}-{args.scale}x-s{args.seed}"
    peer = cell / f"{args.peer}-{args.setting}" / "vllm"
    if not (cell / "ours-vllm").is_dir() or not peer.is_dir():
        sys.exit(f"peer_ablation: {cell} has no pair of heads; run bench/peer_parity.py --settings {args.setting} "
                 "first")
    gated = variant_cell(work, cell, "ours-gate-input")
    pr.train_ours(gated, args.steps * args.scale, ["train.mask_gate=input"], seed=args.seed)

    recipe = pr.base_recipe()
    sets = pp.prompt_sets(args.data, args.prompts, max(args.regen_rows, args.rows * args.scale))
    job = pp.scoring_job(recipe, sets, args.new_tokens, args.max_k)  # as peer_parity's, so its runs are reused
    plain = pp.served({**job, "head": None}, work / f"plain-{args.data}", "vllm-plain")
    # the cell's two heads as peer_parity scored them (its vLLM runs are reused), then the variant
    scored = {("ours", "recipe"): pp.score(cell, job, plain, [args.k], cell / "ours-vllm"),
              (args.peer, args.setting): pp.score(cell, job, plain, [args.k], peer),
              ("ours", "mask_gate input"): pp.score(gated, job, plain, [args.k], gated / "ours-vllm")}
    results: dict = {}
    for which, by_k in scored.items():
        for name, r in by_k[args.k].items():
            results.setdefault(name, {})[which] = (from_counts(r["counts"]), r["lossless"])
    report(results, args, cell.name)
    return 0


def report(results: dict, args: argparse.Namespace, cell: str) -> None:
    print(f"{cell}, k = {args.k}\n")
    print("| prompts | trainer | variant | α_1 ± SE | MAL ± SE | drafts | lossless |")
    print("|---|---|---|---:|---:|---:|---|")
    for name, by_variant in results.items():
        for (trainer, variant), (a, lossless) in by_variant.items():
            print(f"| {name} | {trainer} | {variant} | {a.alphas[0]:.3f} ± {a.se_alpha1:.3f} | {a.mal:.3f} ± "
                  f"{a.se_mal:.3f} | {a.drafts} | {'yes' if lossless else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
