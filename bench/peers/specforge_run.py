"""The peer trainer's side of the SpecForge-vs-mtp-train parity benchmark: SpecForge 0.2.0 trains an EAGLE-3 head
on our tokens and draft vocabulary, offline, on the CPU, and exports it for vLLM.

    .venv-peers/bin/python bench/peers/specforge_run.py JOB.json        # `make peers` builds .venv-peers

JOB.json: ``{"target": HF Llama dir, "tokens": JSONL of {"input_ids": [...], "loss_mask": [...]} (already rendered
and masked; trained as they are), "vocab": safetensors with d2t int64 [N] (target = draft + d2t[draft]) and t2d bool
[V], or null for SpecForge's own (the ``draft_vocab`` most frequent trained ids, 32000 by default), "max_length",
"ttt_length", "lr", "warmup_steps" (or "warmup_ratio", SpecForge's own measure), "total_steps", "batch_size" (rows
per step), "seed", "threads", "out": DIR}``; optional "workers" (SpecForge's loader threads, 0 unless given).

Steps, all under OUT: (1) ``features/``: offline features in SpecForge's format (bench/peers/capture.py: a
transformers forward with hooks, as SpecForge's SGLang capture needs CUDA); (2) ``vocab_mapping.pt`` (the job's
d2t/t2d, so SpecForge computes none; with no job vocabulary, SpecForge's own, found in its cache after training),
``draft_config.json`` (SpecForge's default 1-layer Llama draft for the target, draft_vocab_size N), ``run.yaml``,
then ``specforge train -c run.yaml`` logging to ``train.log``; (3) ``specforge
export --to sglang`` into ``vllm/`` (SpecForge 0.2.0 has no ``--to vllm``: its SGLang layout, ``midlayer.*``, ``fc``,
``norm``, ``lm_head``, ``d2t``, ``t2d`` and ``LlamaForCausalLMEagle3``, is what vLLM's eagle3 loader reads); (4)
``result.json``, written atomically. Runs inside .venv-peers (SpecForge's transformers, CPU torch) and imports
nothing of the project.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from capture import read_rows, write_features  # noqa: E402  (bench/peers/capture.py: torch only at import)
FIELDS = ("target", "tokens", "vocab", "max_length", "ttt_length", "lr", "total_steps", "batch_size", "seed",
          "threads", "out")
DRAFT_VOCAB = 32000  # SpecForge's default draft vocabulary (its Llama-3 8B draft config)
SPECFORGE = [sys.executable, "-m", "specforge.cli"]
STEP_LINE = re.compile(r"^step (\d+): (\{.*\})$")


def load_job(path: str) -> dict:
    """The job, every field present; ``out`` made absolute."""
    job = json.loads(Path(path).read_text())
    missing = [name for name in FIELDS if name not in job] + (
        [] if "warmup_steps" in job or "warmup_ratio" in job else ["warmup_steps or warmup_ratio"])
    if missing:
        raise SystemExit(f"{path}: missing {missing}")
    job["out"] = str(Path(job["out"]).resolve())
    return job


def capture_features(job: dict, rows: list[dict], out: Path) -> tuple[int, int, float]:
    """Target forward over every row into ``out`` (fp32, the training dtype). Returns (bytes, tokens, seconds)."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    size, tokens = write_features(model, rows, out, job["max_length"], dtype=torch.float32)
    return size, tokens, time.perf_counter() - start


def write_vocab_mapping(vocab: str, out: Path) -> tuple[Path, int]:
    """The job's d2t [N] and t2d [V] as SpecForge's vocab-mapping file (a torch dict). Returns (path, N)."""
    from safetensors.torch import load_file

    mapping = load_file(vocab)
    d2t, t2d = mapping["d2t"].to(torch.int64), mapping["t2d"].to(torch.bool)
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[torch.arange(d2t.numel()) + d2t].all()):
        raise SystemExit(f"{vocab}: d2t and t2d do not describe the same draft vocabulary")
    path = out / "vocab_mapping.pt"
    torch.save({"d2t": d2t, "t2d": t2d}, path)
    return path, d2t.numel()


def run_config(job: dict, features: Path, vocab_mapping: Path | None, tied: bool) -> dict:
    """SpecForge's run YAML for one offline, single-process, fp32 CPU run of exactly ``total_steps`` steps (with no
    ``vocab_mapping``, SpecForge derives its own from the features)."""
    steps = job["total_steps"]
    # SpecForge takes a ratio and warms up int(ratio * total) steps; its cosine after the warm-up divides by the steps
    # left, so at least one is left.
    ratio = job["warmup_ratio"] if "warmup_ratio" in job else min((steps - 1 + 1e-6) / steps,
                                                                  (job["warmup_steps"] + 1e-6) / steps)
    rows = sum(1 for _ in features.rglob("*.ckpt"))
    epochs = math.ceil(steps / max(1, rows // job["batch_size"]))
    return {
        "model": {"target_model_path": job["target"], "torch_dtype": "float32",
                  "vocab_mapping_path": str(vocab_mapping or ""),
                  # A tied target has no lm_head.weight: the teacher head is the embedding.
                  "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight"},
        "data": {"hidden_states_path": str(features), "max_length": job["max_length"],
                 "dataloader_num_workers": job.get("workers", 0), "cache_dir": str(Path(job["out"]) / "cache")},
        "training": {"strategy": "eagle3", "num_epochs": epochs, "max_steps": steps, "total_steps": steps,
                     "batch_size": job["batch_size"], "learning_rate": job["lr"], "lr_scheduler": "cosine",
                     "warmup_ratio": ratio, "ttt_length": job["ttt_length"],
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "seed": job["seed"],
                     "log_interval": 1, "save_interval": 0},
        "run_id": "specforge-peer",
        "output_dir": str(Path(job["out"]) / "run"),
    }


def write_draft_config(run: dict, draft_vocab: int, out: Path) -> Path:
    """SpecForge's default EAGLE-3 draft for the target (1 Llama layer, its dims) with ``draft_vocab`` rows."""
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.config import Config
    from specforge.training.model_loading import resolve_draft_config

    config = resolve_draft_config(Config.model_validate(run), provider=algorithm_providers().model.draft_config)
    config.draft_vocab_size = draft_vocab
    path = out / "draft_config.json"
    path.write_text(json.dumps(config.to_dict(), indent=2))
    return path


def specforge(args: list[str], log: Path, threads: int) -> float:
    """One ``specforge ARGS`` subprocess, its output appended to ``log``. Returns its wall time."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "SPECFORGE_FP32": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.run([*SPECFORGE, *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    if proc.returncode != 0:
        raise SystemExit(f"specforge {args[0]} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - start


def step_metrics(log: Path) -> list[dict]:
    """SpecForge's console lines ``step N: {...}`` (log_interval 1: one per optimizer step)."""
    found = []
    for line in log.read_text().splitlines():
        match = STEP_LINE.match(line.strip())
        if match:
            found.append({"step": int(match.group(1)), **json.loads(match.group(2).replace("'", '"'))})
    return found


def tokens_fed(features: Path, job: dict) -> int:
    """Non-padding tokens of the rows SpecForge's offline sampler feeds in ``total_steps`` steps of ``batch_size``
    rows (its own shuffle: ``randperm(seed + epoch)`` over the sorted files, the short last batch dropped)."""
    from specforge.launch import _shard_offline_refs
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    files = list_feature_files(str(features))
    length = {path: int(torch.load(path, weights_only=True, mmap=True)["input_ids"].numel()) for path in files}
    batch, total, epoch, steps = job["batch_size"], 0, 0, 0
    while steps < job["total_steps"]:
        order = _shard_offline_refs(files, use_usp_preprocess=False, seed=job["seed"], epoch=epoch, dp_rank=0,
                                    dp_size=1)
        for start in range(0, len(order) - batch + 1, batch):
            if steps == job["total_steps"]:
                break
            total += sum(min(length[p], job["max_length"]) for p in order[start:start + batch])
            steps += 1
        epoch += 1
    return total


def lr_per_step(lr: float, total: int, warmup: int) -> list[float]:
    """The learning rate each optimizer step uses under SpecForge's own CosineAnnealingWarmupLR (on this torch)."""
    from specforge.lr_scheduler import CosineAnnealingWarmupLR

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "use get_last_lr()" from inside SpecForge's scheduler
        scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=total, warmup_steps=warmup)
        for _ in range(total):
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return used


def effective_settings(job: dict, run: dict) -> dict:
    """What SpecForge 0.2.0 does with this run, from its source (optimizer.py, lr_scheduler.py, eagle3/model.py,
    core/loss.py, strategies/base.py), where it differs from a plain per-token mean."""
    t = run["training"]
    warmup = int(t["warmup_ratio"] * t["total_steps"])
    lrs = lr_per_step(t["learning_rate"], t["total_steps"], warmup)
    return {
        "optimizer": "AdamW over fp32 masters (BF16Optimizer), betas (0.9, 0.999), eps 1e-8, weight_decay 0",
        "grad_clip": 0.5, "lr": t["learning_rate"], "warmup_steps": warmup,
        "schedule": "linear warmup from lr/warmup, then cosine over total - warmup steps to eta_min 0 (floor 0); "
                    "torch's chainable cosine update bumps the first step after warmup (x2 when total - warmup = 2)",
        "lr_first_steps": [round(x, 9) for x in lrs[:warmup + 3]], "lr_last_step": round(lrs[-1], 9),
        "lr_peak": round(max(lrs), 9),
        "ttt_length": t["ttt_length"], "step_weights": [0.8 ** i for i in range(t["ttt_length"])],
        "loss_normalisation": "per TTT step: sum over positions of masked soft CE, divided by batch x padded length "
                              "(padding counted); total = sum_i 0.8^i loss_i",
        "mask_alignment": "position j (embedding of token j+1, features of j) predicts token j+2 and is gated on "
                          "loss_mask[j]; each TTT step shifts the mask left by one; the last token's mask is zeroed",
        "teacher": "softmax of the target's full-vocabulary logits restricted to the draft ids (renormalised)",
        "skip_outside_vocab": "a position counts only if the target's top-1 id is in the draft vocabulary",
        "attention_backend": t["attention_backend"], "dtype": "float32", "batch_size": t["batch_size"],
        "max_length": run["data"]["max_length"], "seed": t["seed"],
    }


def version() -> str:
    from importlib.metadata import version as installed

    return installed("specforge")


def export(out: Path, draft_config: Path, vocab_mapping: Path, threads: int) -> Path:
    """``specforge export --to sglang`` of the run's last checkpoint into ``OUT/vllm``, fp32 (patched)."""
    target = out / "vllm"
    specforge(["export", "--to", "sglang", "--checkpoint", str(out / "run"), "--draft-config", str(draft_config),
               "--output-dir", str(target), "--vocab-mapping", str(vocab_mapping)], out / "export.log", threads)
    return target


def write_json(path: Path, value: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value, indent=2))
    os.replace(path.with_suffix(".tmp"), path)


def main(job_path: str) -> int:
    job = load_job(job_path)
    out = Path(job["out"])
    for stale in ("features", "run", "vllm", "cache"):  # a rerun starts afresh: no old rows, checkpoint or mapping
        shutil.rmtree(out / stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    features = out / "features"
    size, tokens, capture_s = capture_features(job, read_rows(job["tokens"], job["max_length"]), features)
    vocab_mapping, draft_vocab = (write_vocab_mapping(job["vocab"], out) if job["vocab"] else
                                  (None, job.get("draft_vocab", DRAFT_VOCAB)))
    tied = bool(json.loads((Path(job["target"]) / "config.json").read_text()).get("tie_word_embeddings", False))
    run = run_config(job, features, vocab_mapping, tied)
    run["model"]["draft_model_config"] = str(write_draft_config(run, draft_vocab, out))
    (out / "run.yaml").write_text(json.dumps(run, indent=2))  # JSON is YAML; SpecForge reads it as .yaml
    log = out / "train.log"
    log.write_text("")
    process_s = specforge(["train", "-c", str(out / "run.yaml")], log, job["threads"])
    steps = step_metrics(log)
    step_s = [s["perf/optimizer_step_time_s"] for s in steps]
    if vocab_mapping is None:  # the one SpecForge derived and cached (training/assembly.py)
        (vocab_mapping,) = (out / "cache" / "vocab_mapping").glob("*.pt")
    export(out, Path(run["model"]["draft_model_config"]), vocab_mapping, job["threads"])
    trained = tokens_fed(features, job)
    train_s = sum(step_s)
    compute_s = sum(s.get("perf/train_compute_time_s", 0.0) for s in steps)
    result = {
        "specforge": version(), "job": job, "capture_s": round(capture_s, 3), "train_s": round(train_s, 3),
        "train_s_source": "sum of SpecForge's per-step perf/optimizer_step_time_s (log_interval 1): the fit loop's "
                          "wall time per step, its loader's wait included (its controller times the whole window), "
                          "without process start, model loading or the final checkpoint",
        "compute_s": round(compute_s, 3), "data_wait_s": round(sum(s.get("perf/data_wait_time_s", 0.0)
                                                                   for s in steps), 3),
        "train_process_s": round(process_s, 3), "steps": len(steps), "step_s": [round(s, 3) for s in step_s],
        "steady_step_s": round(statistics.median(step_s[1:]), 3) if len(step_s) > 1 else None,
        "tokens_trained": trained, "tokens_per_s": round(trained / train_s, 1) if train_s else None,
        "compute_tokens_per_s": round(trained / compute_s, 1) if compute_s else None,
        "feature_bytes": size, "feature_tokens": tokens, "bytes_per_token": round(size / max(1, tokens), 1),
        "loss": [s.get("train/loss", s.get("loss")) for s in steps],
        "config": effective_settings(job, run),
        "notes": [
            "features captured with a transformers forward and hooks (bench/peers/capture.py), fp32: SpecForge feeds "
            "stored features to the draft without a cast, so they are stored in the training dtype",
            "exported with `specforge export --to sglang` (0.2.0 has no --to vllm); vLLM reads that layout as eagle3",
            f"patched SpecForge for the CPU: {HERE / 'specforge-cpu.patch'}",
        ],
    }
    if len(steps) != job["total_steps"]:
        result["notes"].append(f"SpecForge logged {len(steps)} steps, the job asked for {job['total_steps']}")
    write_json(out / "result.json", result)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1]))
