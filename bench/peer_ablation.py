"""Why one bench/peer_parity.py cell came out as it did: both trainers again at other training seeds, and ours with
SpecForge's loss-mask gate, each head served by vLLM at one k on the cell's prompt sets.

    .venv/bin/python bench/peer_parity.py                      # first: the cell and its seed-0 heads
    .venv/bin/python bench/peer_ablation.py [--data sgd] [--scale 1] [--seeds 1 2] [--k 3]

Give it the --work, --rows, --steps, --prompts, --new-tokens and --regen-rows peer_parity ran with (the defaults
match). Seed 0 is the cell's own pair of heads. Each other variant trains in WORK/ablation/CELL-VARIANT on the
cell's conversations; SpecForge's variants read the token ids, loss masks and draft vocabulary of our seed-0 run, as
peer_parity's SpecForge run does. ``ours, mask_gate input`` is our seed-0 recipe with ``train.mask_gate: input``,
the gate SpecForge uses. Prints α_1 and MAL ± SE per variant and prompt set, then per prompt set the spread of α_1
over the seeds of each trainer, beside the gap between the two seed-0 heads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

import peer_parity as pp  # noqa: E402
from peer_table import from_counts  # noqa: E402


def variant_cell(work: Path, cell: Path, name: str) -> Path:
    """WORK/ablation/CELL-NAME holding the cell's conversations."""
    out = work / "ablation" / f"{cell.name}-{name}"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "conversations.jsonl").is_file() or (out / "conversations.jsonl").read_bytes() != (
            cell / "conversations.jsonl").read_bytes():
        shutil.copyfile(cell / "conversations.jsonl", out / "conversations.jsonl")
    return out


def specforge_at(work: Path, cell: Path, ours: dict, seed: int, threads: int) -> Path:
    """SpecForge at ``seed`` on the seed-0 run's tokens and vocabulary; its exported head."""
    out = variant_cell(work, cell, f"specforge-seed{seed}")
    for name in ("ours", "ours-vllm"):  # peer_inputs reads our features and exported vocabulary from here
        if not (out / name).exists():
            (out / name).symlink_to(cell / name, target_is_directory=True)
    recipe = pp.base_recipe()
    recipe["seed"] = seed
    pp.train_specforge(out, ours, recipe, threads)
    return out / "specforge" / "vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("dolly", "sgd"), default="sgd")
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="training seeds besides 0")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-k", type=int, default=4, help="peer_parity's largest k (it sizes vLLM's context)")
    parser.add_argument("--rows", type=int, default=80)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--regen-rows", type=int, default=1280)
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    work = args.work.resolve()
    cell = work / f"{args.data}-{args.scale}x"
    if not (cell / "ours-vllm").is_dir() or not (cell / "specforge" / "vllm").is_dir():
        sys.exit(f"peer_ablation: {cell} has no pair of heads; run bench/peer_parity.py first")
    steps = args.steps * args.scale
    ours = json.loads((work / "peer_parity.json").read_text())["cells"][f"{args.data} × {args.scale}"]["ours"]
    heads = {("ours", "seed 0"): cell / "ours-vllm", ("specforge", "seed 0"): cell / "specforge" / "vllm"}
    for seed in args.seeds:
        mine = variant_cell(work, cell, f"ours-seed{seed}")
        pp.train_ours(mine, steps, [f"seed={seed}"])
        heads[("ours", f"seed {seed}")] = mine / "ours-vllm"
        heads[("specforge", f"seed {seed}")] = specforge_at(work, cell, ours, seed, args.threads)
    gated = variant_cell(work, cell, "ours-gate-input")
    pp.train_ours(gated, steps, ["train.mask_gate=input"])
    heads[("ours", "mask_gate input")] = gated / "ours-vllm"

    recipe = pp.base_recipe()
    sets = pp.prompt_sets(args.data, args.prompts, max(args.regen_rows, args.rows * args.scale))
    job = pp.scoring_job(recipe, sets, args.new_tokens, args.max_k)  # as peer_parity's, so its runs are reused
    plain = pp.served({**job, "head": None}, work, f"vllm-{args.data}-plain")
    results: dict = {}
    for (trainer, variant), head in heads.items():
        where = cell if variant == "seed 0" else head.parents[1 if trainer == "specforge" else 0]
        result = pp.served({**job, "head": str(head), "k": args.k, "method": "eagle3"}, where,
                           f"vllm-{trainer}-k{args.k}")
        for name, r in result["sets"].items():
            lossless = r["tokens"] == plain["sets"][name]["tokens"]
            results.setdefault(name, {})[(trainer, variant)] = (from_counts(r["counts"]), lossless)
    report(results, args, cell.name)
    return 0


def report(results: dict, args: argparse.Namespace, cell: str) -> None:
    print(f"{cell}, k = {args.k}\n")
    print("| prompts | trainer | variant | α_1 ± SE | MAL ± SE | drafts | lossless |\n|---|---|---|---:|---:|---:|---|")
    for name, by_variant in results.items():
        for (trainer, variant), (a, lossless) in by_variant.items():
            print(f"| {name} | {trainer} | {variant} | {a.alphas[0]:.3f} ± {a.se_alpha1:.3f} | {a.mal:.3f} ± "
                  f"{a.se_mal:.3f} | {a.drafts} | {'yes' if lossless else 'NO'} |")
    print("\nα_1 over training seeds (mean, sample SD, min..max), and the seed-0 gap (ours − SpecForge):")
    for name, by_variant in results.items():
        spread = {}
        for trainer in ("ours", "specforge"):
            alphas = [a.alphas[0] for (t, v), (a, _) in by_variant.items() if t == trainer and v.startswith("seed")]
            sd = statistics.stdev(alphas) if len(alphas) > 1 else 0.0
            spread[trainer] = f"{statistics.mean(alphas):.3f}, SD {sd:.3f}, {min(alphas):.3f}..{max(alphas):.3f}"
        gap = by_variant[("ours", "seed 0")][0].alphas[0] - by_variant[("specforge", "seed 0")][0].alphas[0]
        print(f"- {name}: ours {spread['ours']}; SpecForge {spread['specforge']}; seed-0 gap {gap:+.3f}")


if __name__ == "__main__":
    sys.exit(main())
