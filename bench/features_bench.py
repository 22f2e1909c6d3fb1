"""Offline against online training, and bf16 against fp8 features, side by side in one run.

    .venv/bin/python bench/features_bench.py RECIPE.yaml --out runs/features-bench [KEY=VALUE ...]
        [--variants offline,online,online_cache,fp8] [--eval [VARIANTS]] [--answers FEATURES_DIR]

Each variant is the recipe with its own ``output_dir`` under ``--out`` and its overrides (``VARIANTS``). For each, one
after the other on the same machine: ``mtp-train precompute`` then ``mtp-train train`` (then ``mtp-train eval`` with
``--eval``), each a process of its own, timed, with its peak RSS (``ru_maxrss`` of the stage's process). It prints:

- throughput: training tokens (the train log's, all steps) over the precompute and train wall time together,
  each variant's over offline's;
- peak RSS of precompute and of training, and the disk: the features' shard bytes and the whole features folder;
- with ``--eval`` (every variant, or those it lists): bytes per token, held-out top-1 per unrolled step (the
  trainer's final validation), and α₁ and τ at each k at T = 0 from the report, each against offline's.

``--answers DIR`` copies a features folder's regenerated answers (``regenerated.rank-*.jsonl``) into every variant
first, so that no variant times the regeneration (it is the same for all). A variant whose stage is already
complete is skipped by the stage itself (delete ``--out`` to measure again).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import machine_line  # noqa: E402

VARIANTS = {
    "offline": [],
    "online": ["precompute.mode=online"],
    "online_cache": ["precompute.mode=online", "precompute.online_cache_gb=4"],
    "fp8": ["precompute.hidden_dtype=fp8"],
}
# Runs a stage's command and prints its peak RSS (KiB) last: the stage is this wrapper's only child.
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def stage(name: str, recipe: Path, overrides: list[str], log: Path) -> dict:
    """Run ``mtp-train NAME RECIPE OVERRIDES`` with its output in ``log``; its wall time and peak RSS."""
    cmd = [sys.executable, "-c", PEAK, sys.executable, "-m", "mtp_train.cli", name, str(recipe), *overrides]
    began = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        sys.exit(f"features_bench: {name} failed ({proc.returncode}); see {log}")
    peak_kib = int(log.read_text().strip().splitlines()[-1])
    return {"s": seconds, "rss": peak_kib * 1024}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_variant(name: str, recipe: Path, common: list[str], out: Path, answers: Path | None, evaluate: bool) -> dict:
    root = out / name
    root.mkdir(parents=True, exist_ok=True)
    overrides = [f"output_dir={root.resolve()}", *common, *VARIANTS[name]]
    features = root / "features"
    if answers is not None:
        features.mkdir(exist_ok=True)
        for f in answers.glob("regenerated.rank-*.jsonl"):
            if not (features / f.name).exists():
                shutil.copy2(f, features / f.name)
    result = {"precompute": stage("precompute", recipe, overrides, root / "precompute.log"),
              "train": stage("train", recipe, overrides, root / "train.log")}
    kind = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("head.kind=")), None)
    logs = sorted(root.glob(f"train_log.{kind or '*'}.jsonl"))
    result["tokens"] = sum(json.loads(line)["tokens"] for line in logs[0].read_text().splitlines())
    manifest = json.loads((features / "manifest.json").read_text())
    result["shard_bytes"] = manifest["totals"]["bytes"]
    result["bytes_per_token"] = manifest["totals"]["bytes_per_token"]
    result["folder_bytes"] = folder_bytes(features)
    head = json.loads((root / "heads" / (kind or logs[0].name.split(".")[1]) / "config.json").read_text())
    result["val_top1"] = head["validation"]["val_top1"]
    if evaluate:
        result["eval"] = stage("eval", recipe, overrides, root / "eval.log")
        report = json.loads((root / "eval" / "report.json").read_text())
        points = {p["k"]: p for p in report["sweep"] if p["temperature"] == 0.0}
        result["alpha1"] = {k: p["alpha"][0] for k, p in sorted(points.items())}
        result["tau"] = {k: p["tau"] for k, p in sorted(points.items())}
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def print_tables(results: dict[str, dict]) -> None:
    base = results.get("offline")
    print("| variant | precompute s | train s | tokens trained | tokens/s (precompute + train) | vs offline | "
          "peak RSS precompute MiB | peak RSS train MiB | shard bytes | features folder bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        rate = r["tokens"] / (r["precompute"]["s"] + r["train"]["s"])
        ratio = rate / (base["tokens"] / (base["precompute"]["s"] + base["train"]["s"])) if base else float("nan")
        print(f"| {name} | {r['precompute']['s']:.0f} | {r['train']['s']:.0f} | {r['tokens']:,} | {rate:,.0f} | "
              f"{ratio:.3f}× | {mib(r['precompute']['rss'])} | {mib(r['train']['rss'])} | {r['shard_bytes']:,} | "
              f"{r['folder_bytes']:,} |")
    evaluated = {name: r for name, r in results.items() if "tau" in r}
    if not evaluated:
        return
    ks = sorted(next(iter(evaluated.values()))["tau"])
    print()
    print("| variant | bytes/token | vs offline | held-out top-1 per step | " + " | ".join(f"α₁ k={k}" for k in ks)
          + " | " + " | ".join(f"τ k={k}" for k in ks) + " |")
    print("|---|---:|---:|---|" + "---:|" * (2 * len(ks)))
    for name, r in evaluated.items():
        per = r["bytes_per_token"] / base["bytes_per_token"] if base and base["bytes_per_token"] else float("nan")
        print(f"| {name} | {r['bytes_per_token']:,} | {per:.3f}× | {r['val_top1']} | "
              + " | ".join(f"{r['alpha1'][k]:.3f}" for k in ks) + " | "
              + " | ".join(f"{r['tau'][k]:.3f}" for k in ks) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="offline,online,online_cache,fp8")
    parser.add_argument("--eval", nargs="?", const="all", default="",
                        help="also run the eval stage: of every variant, or of those listed (comma-separated)")
    parser.add_argument("--answers", type=Path, help="a features folder whose regenerated answers every variant reuses")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    print(machine_line())
    print(f"recipe {args.recipe} {' '.join(args.overrides)}")
    results = {}
    for name in names:
        evaluate = args.eval == "all" or name in args.eval.split(",")
        results[name] = run_variant(name, args.recipe, args.overrides, args.out, args.answers, evaluate)
        print(f"features_bench: {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    print_tables(results)


if __name__ == "__main__":
    main()
