"""Fine-tuning a head from another data set against training one from scratch, on the target's own answers.

    .venv/bin/python bench/finetune_table.py run [--recipe recipes/smollm2.yaml] [--steps 300] [--fraction 0.2] \\
        [--seeds 0 1 2] [--retrain]     # every arm of every seed, each point appended as it lands
    .venv/bin/python bench/finetune_table.py table [bench/finetune/smollm2.jsonl]

A team holds a head trained elsewhere (here: SGD's dialogues as written, ``--steps`` steps) and fine-tunes it with
``head.init_from`` on the target's own answers (the recipe's regenerated data) for ``--fraction`` of those steps.
Against it, heads trained from scratch on the same answers: for as many steps as the fine-tune (the team's budget),
and for the fine-tuned head's total (``--steps`` × (1 + ``--fraction``)). Per seed (each arm's training seed and its
eval prompts), the arms are:

- ``source``: SGD as written, ``--steps`` steps (the head a team would import);
- ``finetuned``: ``source`` fine-tuned on the answers, ``--fraction`` × ``--steps`` steps;
- ``scratch-equal``: from scratch on the answers, as many steps as ``finetuned``;
- ``scratch-total``: from scratch on the answers, ``--steps`` × (1 + ``--fraction``) steps.

Every arm takes the recipe's other settings (lr, warm-up then cosine decay to its own length, batch tokens), and
every arm is evaluated the same way, on the recipe's features: its prompt sets (the held-out answers' prompts among
them), at most 8 prompts each, 48 new tokens, T = 0, k = 3, lossless. The answers' features are the recipe's own
(``OUTPUT_DIR/features``, its regeneration included), so ``mtp-train RECIPE`` later reuses them. A point already in
the results file is reused (``run`` says so) unless ``--retrain``; the table gives each arm's mean ± standard error
over seeds and the fine-tuned head's paired differences, seed by seed (the same eval prompts).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import machine_line  # noqa: E402
from bench.scaling import _cli, _mean_se, _read, _se  # noqa: E402
from mtp_train.io import write_atomic  # noqa: E402

SOURCE_DATA = REPO / "data" / "sgd" / "sgd_train_sharegpt.jsonl.gz"
ARMS = ("source", "finetuned", "scratch-equal", "scratch-total")
K = 3


def _source(root: Path) -> list[str]:
    """The overrides that train on SGD's dialogues as written, into features of their own under ``root``."""
    return [f"data.train={SOURCE_DATA}", "data.format=sharegpt", "data.regenerate=false",
            f"precompute.features_dir={root / 'source-features'}"]


def _run_dir(root: Path, arm: str, steps: int, fraction: float, seed: int) -> Path:
    return root / f"{arm}-{steps}x{fraction:g}-s{seed}"


def _steps(arm: str, steps: int, fraction: float) -> int:
    return {"source": steps, "finetuned": round(steps * fraction), "scratch-equal": round(steps * fraction),
            "scratch-total": steps + round(steps * fraction)}[arm]


def _point(recipe: Path, root: Path, arm: str, steps: int, fraction: float, seed: int, extra: list[str]) -> dict:
    """Train ``arm`` at ``seed`` (the source head first, for the fine-tune) and evaluate it on the recipe's features;
    the point's record. A run stopped midway resumes from its last checkpoint."""
    from mtp_train.recipe import load_recipe

    base = load_recipe(recipe, extra)
    out = _run_dir(root, arm, steps, fraction, seed)
    n = _steps(arm, steps, fraction)
    answers = [f"precompute.features_dir={base.features_dir}"]
    start = ([f"head.init_from={_run_dir(root, 'source', steps, fraction, seed) / 'heads' / base.head.kind}"]
             if arm == "finetuned" else [])
    common = [*extra, f"output_dir={out}", f"seed={seed}", "eval.compare=[]"]
    train_s = _cli("train", str(recipe), *common, *(_source(root) if arm == "source" else answers), *start,
                   f"train.max_steps={n}", f"train.val_every={n}", f"train.save_every={n}", "train.tau_every=0",
                   "train.wandb_mode=disabled")
    eval_s = _cli("eval", str(recipe), *common, *answers, *start, f"eval.k=[{K}]", "eval.temperatures=[0.0]",
                  "eval.trees=[]", "eval.max_prompts=8", "eval.max_new_tokens=48", "eval.batch_size=8")
    report = json.loads((out / "eval" / "report.json").read_text())
    at = {p["k"]: p for p in report["sweep"]}[K]
    log = [json.loads(line) for line in (out / f"train_log.{base.head.kind}.jsonl").read_text().splitlines()]
    return {
        "recipe": recipe.name, "arm": arm, "steps": n, "source_steps": steps, "fraction": fraction, "seed": seed,
        "tokens": sum(r["tokens"] for r in log), "tau": at["tau"], "alpha1": at["alpha"][0],
        "by_prompt_set": {name: {"tau": g["tau"], "alpha1": g["alpha"][0]} for name, g in at["by_prompt_set"].items()},
        "lossless": report.get("lossless"), "train_cpu_s": round(train_s), "eval_cpu_s": round(eval_s),
        "cpu": report["device"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _key(r: dict) -> tuple:
    return r["recipe"], r["arm"], r["source_steps"], r["fraction"], r["seed"]


def run(args: argparse.Namespace) -> None:
    recipe = Path(args.recipe).resolve()
    results = Path(args.results or REPO / "bench" / "finetune" / f"{recipe.stem}.jsonl")
    results.parent.mkdir(parents=True, exist_ok=True)
    root = REPO / "runs" / "finetune" / recipe.stem
    print(machine_line(), file=sys.stderr)
    _cli("precompute", str(recipe), *args.override)  # the answers, regenerated once, in the recipe's own features
    _cli("precompute", str(recipe), *args.override, f"output_dir={root / 'source'}", *_source(root))
    for seed in args.seeds:
        for arm in ARMS:
            key = (recipe.name, arm, args.steps, args.fraction, seed)
            if key in {_key(r) for r in _read(results)} and not args.retrain:
                print(f"finetune: {arm} seed {seed}: reused from {results} (--retrain trains it again)",
                      file=sys.stderr)
                continue
            if args.retrain:
                shutil.rmtree(_run_dir(root, arm, args.steps, args.fraction, seed), ignore_errors=True)
            started = time.perf_counter()
            point = _point(recipe, root, arm, args.steps, args.fraction, seed, args.override)
            kept = [r for r in _read(results) if _key(r) != key]
            write_atomic(results, "".join(json.dumps(r) + "\n" for r in [*kept, point]))
            print(f"finetune: {arm} seed {seed}: tau@{K} {point['tau']:.3f}, alpha1 {point['alpha1']:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)


def table(args: argparse.Namespace) -> None:
    rows = _read(Path(args.results))
    by_arm = {arm: {r["seed"]: r for r in rows if r["arm"] == arm} for arm in ARMS}
    sets = sorted({name for r in rows for name in r["by_prompt_set"]})
    print(f"| arm | steps | seeds | τ k={K} | α₁ | " + " | ".join(f"τ {s}" for s in sets) + " | CPU min |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(sets) + "---:|")
    for arm, points in by_arm.items():
        if not points:
            continue
        group = list(points.values())
        cpu = sum(r["train_cpu_s"] + r["eval_cpu_s"] for r in group) / 60 / len(group)
        print(f"| {arm} | {group[0]['steps']} | {len(group)} | {_mean_se([r['tau'] for r in group])} | "
              f"{_mean_se([r['alpha1'] for r in group])} | "
              + " | ".join(_mean_se([r["by_prompt_set"][s]["tau"] for r in group]) for s in sets)
              + f" | {cpu:.0f} |")
    print(f"\n| finetuned − | shared seeds | τ k={K}, paired | in SE | α₁, paired | in SE |")
    print("|---|---:|---:|---:|---:|---:|")
    for other in ("scratch-equal", "scratch-total", "source"):
        shared = sorted(by_arm["finetuned"].keys() & by_arm[other].keys())
        if not shared:
            continue
        cells = []
        for metric in ("tau", "alpha1"):
            diff = [by_arm["finetuned"][s][metric] - by_arm[other][s][metric] for s in shared]
            mean, se = statistics.mean(diff), _se(diff)
            cells += [f"{mean:+.3f} ± {se:.3f}", f"{mean / se:.1f}" if se > 0 else "—"]
        print(f"| {other} | {len(shared)} | " + " | ".join(cells) + " |")
    print(f"\nMeasured on: {', '.join(sorted({r['cpu'] for r in rows}))}; every point lossless: "
          f"{all(r['lossless'] for r in rows)}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2.yaml"))
    r.add_argument("--steps", type=int, default=300, help="the source head's steps")
    r.add_argument("--fraction", type=float, default=0.2, help="the fine-tune's steps, as a fraction of --steps")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--results")
    r.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recipe overrides for every run (a smaller check: data.max_rows=200 output_dir=...)")
    r.add_argument("--retrain", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("results", nargs="?", default=str(REPO / "bench" / "finetune" / "smollm2.jsonl"))
    args = parser.parse_args()
    run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    main()
