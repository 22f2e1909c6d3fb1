"""The pipeline part of bench/gpu_check.py: the recipe it runs, the stages beyond the main pipeline that a cluster
takes (an eagle3 head, DeepSpeed in bf16, regeneration, the tiny DeepSeek target, TP = 2 over NCCL), and each
stage's outcome in Markdown."""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SGD = ROOT / "data" / "sgd" / "sgd_train_sharegpt.jsonl.gz"
DEEPSEEK = ROOT / "recipes" / "tiny-deepseek.yaml"


def write_recipe(work: Path, r: dict, backend: str) -> Path:
    """The pipeline's recipe (``r``: the fields the run's size sets), in the work directory."""
    recipe = {
        "output_dir": str(work / "run"), "seed": 0, "threads": 1 if r["train"]["mixed_precision"] == "no" else None,
        "target": {"path": str(work / "target"), "dtype": "auto", "attention_backend": backend},
        "data": {"train": [str(SGD)], "format": "sharegpt", **r["data"]},
        "precompute": {"layers": [-1], "topk": 32, "shard_tokens": 65536, "batch_tokens": 16384},
        "head": {"kind": "mtp", "num_layers": 1, "aux_layers": [1, 2, 3]},  # eagle3 reads layers 1-3 (of 4 or 8)
        "train": {"lr": 1e-3, "warmup_steps": 10, "unroll": 2, "val_every": r["train"]["max_steps"],
                  "save_every": r["train"]["max_steps"], "wandb_mode": "disabled", **r["train"]},
        "eval": {"temperatures": [0.0, 1.0], "compare": ["eagle3"], **r["eval"]},
    }
    (work / "recipe.yaml").write_text(json.dumps(recipe, indent=1) + "\n")  # JSON is YAML
    return work / "recipe.yaml"


def summary(stage: str, run: Path, recipe: dict, out: str) -> tuple[str, list[str]]:
    """A stage's outcome in Markdown, read from what it wrote, and the problems it shows."""
    if stage == "precompute":
        rows = recipe["data"]["max_rows"]
        return f"Precompute: {rows} rows of {SGD.relative_to(ROOT)}.\n\n```\n{out.strip()}\n```\n", []
    if stage.startswith("train"):
        kind = stage.partition(":")[2] or "mtp"
        config = json.loads((run / "heads" / kind / "config.json").read_text())
        log = [json.loads(ln) for ln in (run / f"train_log.{kind}.jsonl").read_text().splitlines() if ln.strip()]
        t, v = recipe["train"], config["validation"]
        return (f"Train: {kind} head, {config['steps']} steps (mixed precision {t['mixed_precision']}, at most "
                f"{t['batch_tokens']:,} tokens a step), loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}; held-out "
                f"loss {v['val_loss']}, top-1 {v['val_top1']}, simulated tau {v['val_tau']}.\n"), []
    r, e = json.loads((run / "eval" / "report.json").read_text()), recipe["eval"]
    lines = [f"Eval: speculative decoding with the mtp head, {r['settings'].get('num_prompts', '?')} prompts from "
             f"{', '.join(e['prompt_sets'])}, batch {e['batch_size']}, {e['max_new_tokens']} new tokens.\n",
             "| k | T | tau | alpha | c | expected | measured | lossless |\n|---:|---:|---:|---|---:|---:|---:|---|"]
    lines += [f"| {p['k']} | {p['temperature']:g} | {p['tau']:.3f} | {[round(a, 3) for a in p['alpha']]} | "
              f"{p['draft_cost_ratio']:.3f} | x{p['expected_speedup']:.2f} | x{p['measured_speedup'] or math.nan:.2f}"
              f" | {p['lossless']} |" for p in r["sweep"]]
    lines += [f"\nHeadline (k={r['k']}, T={r['temperature']:g}): tau {r['tau']:.3f}, measured speedup "
              f"x{r['measured_speedup'] or math.nan:.2f} over plain decoding in the runtime; lossless {r['lossless']}; "
              f"runtime vs trainer validation loss {r['val_loss']} vs {r['trainer_val_loss']} (mismatch "
              f"{r['val_mismatch']}).\n"]
    problems = []
    if r["lossless"] is False:
        problems.append(f"speculative output differs from plain decoding at T=0: {r.get('lossless_detail')}")
    if r["val_mismatch"]:
        problems.append(f"the runtime's and the trainer's validation differ beyond {r['val_tolerance']}")
    return "\n".join(lines), problems


def extra_stages(work: Path, recipe: Path, cli: list[str], smoke: bool, gpus: int
                 ) -> list[tuple[str, list[list[str]], str | None]]:
    """``(name, commands, why it is skipped or None)`` of the stages after the main pipeline, each in its own output
    directory beside ``run/`` (reading its features where it trains): DeepSpeed ZeRO-2 in the recipe's precision
    (bf16 on the GPU), a precompute that regenerates the answers with the target, the whole pipeline on the tiny
    DeepSeek target (MLA and experts), online training on FP8 (the target scoring beside the head on the same
    GPU), and a precompute at TP = 2 over NCCL where two GPUs are present."""
    features = f"precompute.features_dir={work / 'run' / 'features'}"
    small = ["data.max_rows=24", "data.heldout_rows=4"]
    deepseek = [str(DEEPSEEK), f"output_dir={work / 'deepseek'}", *small, "train.max_steps=4", "train.val_every=4",
                "train.save_every=4", "eval.k=[1,2]", "eval.temperatures=[0.0]", "eval.prompt_sets=[heldout]",
                "eval.max_prompts=4", "eval.max_new_tokens=16", "eval.batch_size=4", "train.wandb_mode=disabled"]
    tp2 = None if gpus >= 2 else ("not in --cpu-smoke" if smoke else f"{gpus} GPU here; TP = 2 needs two")
    online = [str(recipe), "precompute.mode=online", "precompute.hidden_dtype=fp8", *small, "train.max_steps=4",
              "train.val_every=4", "train.save_every=4", "eval.compare=[]", f"output_dir={work / 'online'}"]
    return [
        ("train:deepspeed", [cli + ["train", str(recipe), "train.engine=deepspeed", "train.zero_stage=2",
                                    "eval.compare=[]", f"output_dir={work / 'run-deepspeed'}", features]], None),
        ("train:online-fp8", [cli + [stage, *online] for stage in ("precompute", "train")], None),
        ("precompute:regenerate", [cli + ["precompute", str(recipe), "data.regenerate=true", *small,
                                          "data.sampling.max_new_tokens=32", f"output_dir={work / 'regenerate'}"]],
         None),
        ("pipeline:deepseek", [cli + [stage, *deepseek] for stage in ("precompute", "train", "eval")], None),
        ("precompute:tp2", [cli + ["precompute", str(recipe), "target.tp=2", *small, f"output_dir={work / 'tp2'}"]],
         tp2),
    ]
