"""Curves against training tokens: each head kind trained on doubling token budgets, evaluated by the runtime.

    .venv/bin/python bench/scaling.py run --recipe recipes/tiny.yaml --heads mtp eagle3 --budgets 0.25 0.5 1 2 4 \\
        --seeds 0                          # one run per (head, budget, seed), each point appended as it lands
    .venv/bin/python bench/scaling.py table bench/scaling/tiny.jsonl     # the Markdown table
    .venv/bin/python bench/scaling.py positions bench/scaling/tiny.jsonl  # acceptance at each draft position
    .venv/bin/python bench/scaling.py pairs bench/scaling/tiny.jsonl      # differences between heads, seed by seed
    .venv/bin/python bench/scaling.py plot bench/scaling/tiny.jsonl bench/scaling/tiny.png

Every point is a separate training run from scratch (the recipe's schedule: warm-up, then cosine decay to the
point's own budget), so a point is what a run of that budget gives, never a checkpoint of a longer run; its own τ
probes (``train.tau_every``) are recorded beside it. The features are precomputed once per recipe (with the stored
layers that eagle3 and dflash read) and shared. Each point's eval decodes the recipe's prompt sets (at most 16
prompts each, 64 new tokens, batch 8, T = 0) at k = 4, and k = 8 for dflash, and records τ, α₁ (the first draft
position at k = 4), the acceptance rate at each draft position given the ones before, the trainer's held-out top-1
of its first step, the epochs over the training features, and the CPU seconds of training and eval. ``--features
DIR`` trains on a finished precompute instead (a recipe run's features, whose stored layers must serve the heads
asked for).

Each point records the settings it trained with (the recipe's head and train fields its kind reads, resolved with
its overrides), and results are keyed by (head, budget, seed, settings): a point already in the results file is
reused, which `run` says, only while the recipe still resolves to the same settings, so a changed default trains it
again; ``--retrain`` trains it again from scratch (its run directory removed first) and replaces it. Tables and
plots label a point by the settings in which it differs from the recipe as it stands. A point's eval prompts are
drawn by its seed alone, so two heads at one seed decode the same prompts: ``pairs`` gives their difference at each
shared seed, mean ± its standard error, beside the unpaired one (both include the spread of training seed and prompt
draw). Each point is written by appending one JSON line, so an interrupted sweep keeps what it finished, and the
point it was training resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import machine_line  # noqa: E402

CLI = [sys.executable, "-m", "mtp_train.cli"]
PROMPTS = 16
# The head fields each kind reads, and the train fields no head's weights depend on (a point's own length, logging).
HEAD_FIELDS = {
    "mtp": ("num_layers", "init", "convention"),
    "eagle": ("num_layers", "convention"),
    "eagle3": ("num_layers", "aux_layers", "draft_vocab", "fc_norm", "norm_output", "parallel_drafts", "mask_token_id",
               "norm_before_fc", "norm_before_residual"),
    "dflash": ("num_layers", "aux_layers", "block_size", "mask_token_id", "fc_norm"),
}
PER_POINT = {"epochs", "max_steps", "save_every", "keep_checkpoints", "val_every", "tau_every", "tau_prompts",
             "tau_tokens", "wandb_mode", "wandb_project", "engine", "zero_stage"}
DFLASH_ONLY = {"anchors", "block_lengths", "dpace_alpha"}


def settings(recipe: Path, head: str, extra: list[str]) -> dict:
    """The fields a ``head`` point trains with: ``recipe`` resolved with the overrides ``extra``, as
    ``{"head.x": value, "train.y": value}`` (the kind's head fields, every train field but the per-point ones)."""
    from mtp_train.recipe import load_recipe
    from mtp_train.train.checkpoint import LATER_HEAD_FIELDS, LATER_TRAIN_FIELDS, without_later

    r = load_recipe(recipe, [f"head.kind={head}", *extra])
    h = without_later(r.head.model_dump(mode="json"), LATER_HEAD_FIELDS)  # points from before a field keep their key
    t = without_later(r.train.model_dump(mode="json"), LATER_TRAIN_FIELDS)
    skip = PER_POINT | (set() if head == "dflash" else DFLASH_ONLY)
    return {**{f"head.{k}": h[k] for k in HEAD_FIELDS[head] if k in h},
            **{f"train.{k}": v for k, v in t.items() if k not in skip}}


def _cli(*args: str) -> float:
    """Run one ``mtp-train`` command; its CPU seconds (user + system of the child)."""
    before = os.times()
    proc = subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"scaling: `mtp-train {' '.join(args)}` failed:\n{proc.stderr[-3000:]}")
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def _features(recipe: Path, root: Path) -> Path:
    """The recipe's features with the stored layers every head kind reads, precomputed once under ``root``."""
    _cli("precompute", str(recipe), f"output_dir={root / 'base'}", "head.kind=mtp", "eval.compare=[eagle3,dflash]")
    return root / "base" / "features"


def _point(recipe: Path, features: Path, root: Path, head: str, budget_m: float, seed: int, extra: list[str],
           fields: dict, fresh: bool) -> dict:
    """Train ``head`` on ``budget_m`` million tokens with ``seed`` and the recipe overrides ``extra`` (which resolve to
    ``fields``, from ``settings``), and evaluate it; the point's record. The point's run resumes where an earlier one
    was stopped, unless ``fresh`` (``--retrain``) removes that run first."""
    from mtp_train.recipe import load_recipe

    base = load_recipe(recipe)
    steps = max(1, round(budget_m * 1e6 / base.train.batch_tokens))
    digest = hashlib.sha256(_canonical(fields).encode()).hexdigest()[:8]
    out = root / f"{head}-{budget_m:g}M-s{seed}-{digest}"  # a changed default trains in a directory of its own
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    common = [f"output_dir={out}", f"precompute.features_dir={features}", f"head.kind={head}", "eval.compare=[]",
              f"seed={seed}", *extra]
    train_s = _cli("train", str(recipe), *common, f"train.max_steps={steps}", f"train.val_every={steps}",
                   f"train.save_every={steps}", f"train.tau_every={max(10, steps // 8)}", "train.wandb_mode=disabled")
    ks = [4, 8] if head == "dflash" else [4]
    eval_s = _cli("eval", str(recipe), *common, f"eval.k={ks}".replace(" ", ""), "eval.temperatures=[0.0]",
                  "eval.trees=[]", f"eval.max_prompts={PROMPTS}", "eval.max_new_tokens=64", "eval.batch_size=8")
    report = json.loads((out / "eval" / "report.json").read_text())
    at = {p["k"]: p for p in report["sweep"]}
    log = [json.loads(line) for line in (out / f"train_log.{head}.jsonl").read_text().splitlines()]
    config = json.loads((out / "heads" / head / "config.json").read_text())
    manifest = json.loads((features / "manifest.json").read_text())
    tokens = sum(r["tokens"] for r in log)
    return {
        "recipe": recipe.name, "head": head, "budget_m": budget_m, "seed": seed, "overrides": extra, "steps": steps,
        "settings": fields, "tokens": tokens,
        "epochs": round(tokens / manifest["totals"]["tokens"], 3),
        "tau_k4": at[4]["tau"], "tau_k8": at[8]["tau"] if 8 in at else None, "alpha1": at[4]["alpha"][0],
        "alpha1_k8": at[8]["alpha"][0] if 8 in at else None,
        "alpha_by_position": {str(k): at[k]["alpha"] for k in ks},
        "by_prompt_set": {name: {"tau": g["tau"], "alpha1": g["alpha"][0]}
                          for name, g in at[4]["by_prompt_set"].items()},
        "val_top1": config["validation"]["val_top1"][0],
        "probes": [{"tokens": r["train_tokens"], "tau": r["tau"], "alpha1": r["alpha1"]} for r in log if "tau" in r],
        "train_cpu_s": round(train_s), "eval_cpu_s": round(eval_s), "cpu": report["device"],
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _canonical(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True)


def _key(r: dict) -> tuple:
    return r["head"], r["budget_m"], r["seed"], _canonical(r["settings"])


@functools.cache
def _defaults(recipe: str, head: str) -> dict:
    return settings(REPO / "recipes" / recipe, head, [])


def _label(r: dict) -> str:
    """The head kind, and each setting in which the point differs from its recipe's defaults as they stand."""
    now = _defaults(r["recipe"], r["head"])
    diff = [f"{k}={v if isinstance(v, str) else json.dumps(v).replace(' ', '')}"
            for k, v in r["settings"].items() if now.get(k) != v]
    return r["head"] + (f" ({', '.join(diff)})" if diff else "")


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args: argparse.Namespace) -> None:
    recipe = Path(args.recipe).resolve()
    results = Path(args.results or REPO / "bench" / "scaling" / f"{recipe.stem}.jsonl")
    results.parent.mkdir(parents=True, exist_ok=True)
    root = REPO / "runs" / "scaling" / recipe.stem
    print(machine_line(), file=sys.stderr)
    done = {_key(r) for r in _read(results)}
    extra = {}
    for item in args.override:  # KIND:key=value
        kind, _, setting = item.partition(":")
        extra.setdefault(kind, []).append(setting)
    features = Path(args.features).resolve() if args.features else _features(recipe, root)
    for budget in args.budgets:
        for head in args.heads:
            for seed in args.seeds:
                fields = settings(recipe, head, extra.get(head, []))
                key = (head, budget, seed, _canonical(fields))
                if key in done and not args.retrain:
                    print(f"scaling: {head} {budget:g}M seed {seed}: reused from {results} (--retrain trains it "
                          "again)", file=sys.stderr)
                    continue
                started = time.perf_counter()
                point = _point(recipe, features, root, head, budget, seed, extra.get(head, []), fields, args.retrain)
                kept = [r for r in _read(results) if _key(r) != key]
                tmp = results.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in [*kept, point]))
                tmp.replace(results)
                print(f"scaling: {head} {budget:g}M seed {seed}: tau@4 {point['tau_k4']:.3f}, alpha1 "
                      f"{point['alpha1']:.3f}, val top-1 {point['val_top1']:.3f} "
                      f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)


def _se(values: list[float]) -> float:
    """The standard error of the mean of ``values``; 0 for one value."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def _mean_se(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {_se(values):.3f}"


def _groups(rows: list[dict]) -> dict[tuple[str, float], list[dict]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in sorted(rows, key=lambda r: (_label(r), r["budget_m"], r["seed"])):
        groups.setdefault((_label(r), r["budget_m"]), []).append(r)
    return groups


def table(args: argparse.Namespace) -> None:
    rows = _read(Path(args.results))
    sets = sorted({name for r in rows for name in r["by_prompt_set"]})
    print("| head | tokens | epochs | seeds | τ k=4 | τ k=8 | α₁ k=4 | α₁ k=8 | held-out top-1 | "
          + " | ".join(f"τ k=4 {s}" for s in sets) + " | CPU min (train + eval) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(sets) + "---:|")
    for (head, budget), group in _groups(rows).items():
        k8 = [r["tau_k8"] for r in group if r["tau_k8"] is not None]
        a8 = [r["alpha1_k8"] for r in group if r.get("alpha1_k8") is not None]
        per_set = [_mean_se([r["by_prompt_set"][s]["tau"] for r in group if s in r["by_prompt_set"]]) for s in sets]
        cpu = _cpu_hours(group) * 60
        print(f"| {head} | {group[0]['tokens'] / 1e6:.2f}M | {group[0]['epochs']} | {len(group)} | "
              f"{_mean_se([r['tau_k4'] for r in group])} | {_mean_se(k8) if k8 else '—'} | "
              f"{_mean_se([r['alpha1'] for r in group])} | {_mean_se(a8) if a8 else '—'} | "
              f"{_mean_se([r['val_top1'] for r in group])} | "
              + " | ".join(per_set) + f" | {cpu:.0f} |")
    print(f"\nMeasured on: {_machines(rows)}. CPU hours in all: {_cpu_hours(rows):.2f}.")


def _cpu_hours(rows: list[dict]) -> float:
    """CPU hours of training and eval over ``rows``."""
    return sum(r["train_cpu_s"] + r["eval_cpu_s"] for r in rows) / 3600


def positions(args: argparse.Namespace) -> None:
    """The acceptance rate at each draft position at k = 4 (given the positions before), per group of points that
    recorded it: where a head's chain loses its drafts."""
    rows = [r for r in _read(Path(args.results)) if "alpha_by_position" in r]
    print("| head | tokens | seeds | " + " | ".join(f"α{i} k=4" for i in range(1, 5)) + " |")
    print("|---|---:|---:|" + "---:|" * 4)
    for (head, budget), group in _groups(rows).items():
        cells = [_mean_se([r["alpha_by_position"]["4"][i] for r in group]) for i in range(4)]
        print(f"| {head} | {group[0]['tokens'] / 1e6:.2f}M | {len(group)} | " + " | ".join(cells) + " |")


def pairs(args: argparse.Namespace) -> None:
    """τ at k = 4 of every two rows of one budget with at least two seeds in common (over all the files given): the
    higher minus the lower, at each shared seed (the same eval prompts), mean ± SE and that mean in SEs; beside it the
    unpaired difference of the rows' means in the SE of that difference."""
    rows = [r for path in args.results for r in _read(Path(path))]
    by_seed = {key: {r["seed"]: r for r in group} for key, group in _groups(rows).items()}
    print("| higher | lower | tokens | shared seeds | τ k=4 higher − lower, paired | in SE | unpaired, in SE |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for budget in sorted({b for _, b in by_seed}):
        for a, b in itertools.combinations(sorted(label for label, at in by_seed if at == budget), 2):
            shared = sorted(by_seed[a, budget].keys() & by_seed[b, budget].keys())
            if len(shared) < 2:
                continue
            points = {label: by_seed[label, budget] for label in (a, b)}
            hi, lo = (a, b) if sum(points[a][s]["tau_k4"] - points[b][s]["tau_k4"] for s in shared) >= 0 else (b, a)
            diff = [points[hi][s]["tau_k4"] - points[lo][s]["tau_k4"] for s in shared]
            mean, se = statistics.mean(diff), _se(diff)
            ta, tb = ([r["tau_k4"] for r in points[label].values()] for label in (hi, lo))
            d_u, se_u = statistics.mean(ta) - statistics.mean(tb), math.hypot(_se(ta), _se(tb))
            print(f"| {hi} | {lo} | {points[a][shared[0]]['tokens'] / 1e6:.2f}M | {len(shared)} | "
                  f"{mean:.3f} ± {se:.3f} | {_ratio(mean, se)} | {d_u:.3f}, {_ratio(d_u, se_u)} |")


def _ratio(mean: float, se: float) -> str:
    return f"{mean / se:.1f}" if se > 0 else "—"


def _machines(rows: list[dict]) -> str:
    """The CPUs the points ran on; where there are several, the points of each but the most used one, and the CPU
    hours of each."""
    by_cpu: dict[str, list[dict]] = {}
    for r in rows:
        by_cpu.setdefault(r["cpu"], []).append(r)
    if len(by_cpu) == 1:
        return next(iter(by_cpu))
    main = max(by_cpu, key=lambda cpu: len(by_cpu[cpu]))
    parts = []
    for cpu, mine in sorted(by_cpu.items(), key=lambda item: item[0] != main):
        points = ("every other point" if cpu == main else
                  ", ".join(f"{head} {budget:g}M ×{len(g)}" for (head, budget), g in _groups(mine).items()))
        parts.append(f"{cpu} ({points}; {_cpu_hours(mine):.2f} CPU hours)")
    return "; ".join(parts)


def plot(args: argparse.Namespace) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = _read(Path(args.results))
    fig = Figure(figsize=(13, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    heads = sorted({_label(r) for r in rows})
    for i, head in enumerate(heads):
        groups = [(b, g) for (h, b), g in _groups(rows).items() if h == head]
        x = [statistics.mean(r["tokens"] for r in g) for _, g in groups]
        for ax, field, style in ((axes[0], "tau_k4", "-"), (axes[0], "tau_k8", "--"), (axes[1], "alpha1", "-"),
                                 (axes[2], "val_top1", "-")):
            ys = [[r[field] for r in g if r[field] is not None] for _, g in groups]
            if not any(ys):
                continue
            means = [statistics.mean(y) for y in ys]
            errs = [_se(y) for y in ys]
            label = head + (" (k = 8)" if field == "tau_k8" else "")
            ax.errorbar(x, means, yerr=errs, marker="o", linestyle=style, color=f"C{i}", label=label, capsize=3)
    for ax, title in zip(axes, ("τ at k = 4 (dashed: k = 8)", "α₁ at k = 4", "held-out top-1, first draft step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training tokens")
        ax.set_title(title)
    axes[2].legend(*axes[0].get_legend_handles_labels(), fontsize="small", loc="lower right")  # its empty corner
    cpus = sorted({r["cpu"].split(" (")[0].removeprefix("cpu: ") for r in rows})  # the models; the table has the rest
    fig.suptitle(f"{Path(args.results).stem}: " + "; ".join(cpus), fontsize="small")
    fig.savefig(args.png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--recipe", required=True)
    r.add_argument("--heads", nargs="+", default=["mtp", "eagle", "eagle3", "dflash"])
    r.add_argument("--budgets", nargs="+", type=float, required=True, help="millions of training tokens")
    r.add_argument("--seeds", nargs="+", type=int, default=[0])
    r.add_argument("--results", help="JSONL file (default bench/scaling/<recipe>.jsonl)")
    r.add_argument("--features", help="a finished precompute's features directory to train on (default: the "
                   "recipe's, precomputed once under runs/scaling/<recipe>/base)")
    r.add_argument("--retrain", action="store_true", help="train points already in the results again")
    r.add_argument("--override", action="append", default=[], metavar="KIND:KEY=VALUE",
                   help="a recipe override for one head kind's points, e.g. dflash:train.anchors=32 (part of the key)")
    t = sub.add_parser("table")
    t.add_argument("results")
    sub.add_parser("positions").add_argument("results")
    sub.add_parser("pairs").add_argument("results", nargs="+")
    p = sub.add_parser("plot")
    p.add_argument("results")
    p.add_argument("png")
    args = parser.parse_args()
    {"run": run, "table": table, "positions": positions, "pairs": pairs, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
