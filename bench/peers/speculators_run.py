"""The second peer trainer of the EAGLE-3 comparison: speculators 0.9.0 (vLLM's own trainer) trains an EAGLE-3 head
on our tokens, offline, on the CPU, and writes a checkpoint in the speculators format that vLLM serves directly.

    .venv-speculators/bin/python bench/peers/speculators_run.py JOB.json    # `make speculators` builds the venv

JOB.json: ``{"target": HF Llama dir, "tokens": JSONL of {"input_ids": [...], "loss_mask": [...]} (already rendered
and masked; trained as they are), "vocab": safetensors with d2t int64 [N] (target = draft + d2t[draft]) and t2d bool
[V], or null for speculators' own choice, "max_length" (each row cut to it), "ttt_steps", "lr", "total_steps"
(optimizer steps, exactly), "seq_len" (tokens per packed optimizer step: speculators' --total-seq-len), "seed",
"threads", "out": DIR}``; optional "optimizer" ("muon", speculators' default, or "adamw"), "workers" (loader
processes, 0 unless given) and "draft_vocab" (with a null vocab: speculators builds the N most frequent trained ids
from ``token_freq.pt``; absent or null: the full vocabulary, speculators' default).

Steps, all under OUT: (1) ``data/``: the rows as an HF dataset (``input_ids``, ``loss_mask``, ``seq_len``) and
``data/hidden_states/hs_{i}.safetensors`` from a transformers forward (fp32): ``hidden_states`` [T, 4, H] (the
residual entering blocks 2, L//2 and L-3, speculators' default aux ids, then the final state before the norm) and
``token_ids``; (2) ``vocab/{d2t,t2d}.npy`` (the job's) or ``data/token_freq.pt`` (for ``--draft-vocab-size N``);
(3) speculators' own trainer in this process at its defaults, changed only where the CPU needs it (``cpu_patches``),
writing ``ckpt/`` and ``metrics.jsonl``; (4) ``vllm/``: the last checkpoint's ``config.json`` and
``model.safetensors``; (5) ``result.json``, atomically. Imports nothing of the project, and at import time only the
standard library and torch (tests/test_peer_speculators.py loads it in the project's venv).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import read_rows  # noqa: E402  (bench/peers/capture.py: torch only at import)

FIELDS = "target tokens vocab max_length ttt_steps lr total_steps seq_len seed threads out".split()


def load_job(path: str) -> dict:
    """The job, every field present, its paths made absolute."""
    job = json.loads(Path(path).read_text())
    missing = [name for name in FIELDS if name not in job]
    if missing or job.get("optimizer", "muon") not in ("muon", "adamw") or job.get("workers", 0) not in (0, 1):
        raise SystemExit(f"{path}: missing {missing}, or optimizer not muon/adamw, or workers not 0/1")
    for key in ("out", "target", "tokens", "vocab"):  # absolute: the run works in OUT
        job[key] = job[key] and str(Path(job[key]).resolve())
    return job


def aux_layer_ids(num_layers: int) -> list[int]:
    """speculators' default EAGLE-3 aux ids for an ``num_layers``-block target (its models/utils.py), in vLLM's
    convention: id k is the residual stream entering block k, transformers' ``output_hidden_states[k]``."""
    return [2, num_layers // 2, num_layers - 3]


@torch.no_grad()
def capture_states(model: Any, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """One forward of a HF decoder-only ``model`` over ``input_ids`` int64 [T]: [T, len(layer_ids) + 1, H].

    Slot i is the residual entering block ``layer_ids[i]`` (id L, the block count, is the input of the final norm);
    the last slot is always the final state before the model's norm, which speculators' trainer normalises and
    projects with the target's own norm and head. The language-model head never runs.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    blocks = len(base.layers)
    kept: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(_module: Any, args: tuple, kwargs: dict) -> None:
            kept[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    modules = {k: base.layers[k] if k < blocks else base.norm for k in {*layer_ids, blocks}}
    handles = [module.register_forward_pre_hook(keep(k), with_kwargs=True) for k, module in modules.items()]
    try:
        base(input_ids=input_ids[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([kept[k][0] for k in [*layer_ids, blocks]], dim=1)


def write_features(model: Any, rows: list[dict], data: Path, layer_ids: list[int],
                   dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``data/hidden_states/hs_{i}.safetensors`` for row i, as speculators' file backend reads them (its file index
    is the row's index in the dataset). Returns (bytes on disk, tokens)."""
    from safetensors.torch import save_file

    folder = data / "hidden_states"
    folder.mkdir(parents=True, exist_ok=True)
    size = tokens = 0
    for index, row in enumerate(rows):
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        states = capture_states(model, ids, layer_ids).to(dtype).contiguous()
        path = folder / f"hs_{index}.safetensors"
        save_file({"hidden_states": states, "token_ids": ids}, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        size += path.stat().st_size
        tokens += int(ids.numel())
    return size, tokens


def write_dataset(rows: list[dict], data: Path) -> None:
    """The rows as speculators' prepare-data leaves them: an HF dataset on disk, torch format, int64 columns."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                                 "loss_mask": [r["loss_mask"] for r in rows],
                                 "seq_len": [len(r["input_ids"]) for r in rows]})
    dataset.set_format("torch")
    dataset.save_to_disk(str(data))


def write_token_freq(rows: list[dict], path: Path) -> None:
    """``{token id: count}`` over the loss-masked positions: speculators' token_freq.pt (train/vocab_mapping.py)."""
    torch.save(dict(Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m)), path)


def write_vocab(vocab: str, out: Path) -> tuple[Path, Path, int]:
    """The job's d2t [N] and t2d [V] as the .npy files of ``--d2t-path`` / ``--t2d-path``. Returns (d2t, t2d, N)."""
    import numpy as np
    from safetensors.torch import load_file

    mapping = load_file(vocab)
    d2t, t2d = mapping["d2t"].to(torch.int64), mapping["t2d"].to(torch.bool)
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[torch.arange(d2t.numel()) + d2t].all()):
        raise SystemExit(f"{vocab}: d2t and t2d do not describe the same draft vocabulary")
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return out / "d2t.npy", out / "t2d.npy", d2t.numel()


def packing(lengths: list[int], seq_len: int, seed: int, total: int) -> tuple[list[list[int]], int]:
    """The rows of each of the first ``total`` optimizer steps under speculators' own packing sampler (one packed row
    of ``seq_len`` tokens per step, reshuffled each epoch with seed + epoch), and the fewest epochs holding them.
    Its epoch loop does not stop at --max-steps (only the loop over one epoch's batches does): each further epoch
    would run one more step, so --epochs must end on the last step."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=seq_len, lengths=lengths, num_replicas=1, rank=0,
                                                 seed=seed)
    steps: list[list[int]] = []
    epochs = 0
    while len(steps) < total:
        sampler.set_epoch(epochs)
        steps.extend([int(i) for i in batch] for batch in sampler)
        epochs += 1
    return steps[:total], epochs


def train_args(job: dict, data: Path, epochs: int, vocab: tuple | None, draft_vocab: int | None,
               train_ratio: float) -> list[str]:
    """speculators' command line: what the job sets, what the CPU needs, everything else its default."""
    out = Path(job["out"])
    args = ["--verifier-name-or-path", job["target"], "--data-path", str(data), "--save-path", str(out / "ckpt"),
            "--log-dir", str(out / "logs"), "--log-freq", "1",
            "--on-missing", "raise",  # every state is on disk: never ask a vLLM endpoint for one
            "--hidden-states-dtype", "float32",  # the CPU trains in fp32 (bf16 there is slow, autocast is off)
            "--loss-implementation", "eager",  # the fused losses are Triton kernels
            "--draft-attn-impl", "sdpa",  # flex attention is compiled only with CUDA; sdpa takes a dense mask
            "--num-workers", str(job.get("workers", 0)), "--total-seq-len", str(job["seq_len"]),
            "--train-data-ratio", repr(train_ratio), "--max-steps", str(job["total_steps"]), "--epochs", str(epochs),
            "--seed", str(job["seed"]), "--lr", repr(job["lr"]), "--ttt-steps", str(job["ttt_steps"]),
            "--optimizer", job.get("optimizer", "muon"), "--no-resume-from-checkpoint"]
    if vocab is not None:
        args += ["--d2t-path", str(vocab[0]), "--t2d-path", str(vocab[1])]
    elif draft_vocab is not None:
        args += ["--draft-vocab-size", str(draft_vocab)]  # built from data/token_freq.pt, its default path
    return args


class MetricRecords(logging.Handler):
    """speculators' metric records (dicts on the ``speculators.metrics`` logger), kept and written as JSON lines."""

    def __init__(self, path: Path):
        super().__init__()
        self.records, self.path = [], path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            self.records.append(record.msg)
            with open(self.path, "a") as f:
                f.write(json.dumps(record.msg, default=str) + "\n")


def cpu_patches() -> list[str]:
    """The changes speculators 0.9.0 needs to train on a CPU-only torch, made in this process. Returns notes."""
    import speculators.train.trainer as trainer

    # The trainer moves the model and every batch to get_local_rank(), the int 0 without torchrun. torch >= 2.8 maps
    # an int to the current accelerator and raises when there is none.
    trainer.get_local_rank = lambda: "cpu"
    notes = ["speculators.train.trainer.get_local_rank returns 'cpu' (was the int 0, which torch maps to an "
             "accelerator and fails without one)"]
    if not torch.accelerator.is_available():
        # The per-step profile timer (--log-freq 1) calls torch.accelerator.synchronize(), which raises without an
        # accelerator. CPU kernels have finished when they return, so a no-op measures the same.
        torch.accelerator.synchronize = lambda *_args, **_kwargs: None
        notes.append("torch.accelerator.synchronize is a no-op (it raises without an accelerator; speculators' "
                     "step timer calls it at every mark; CPU work is synchronous)")
    return notes


def train(args: list[str], records: MetricRecords) -> Any:
    """speculators' trainer in this process, its metric logger also feeding ``records``. Returns its config."""
    import speculators.train.cli as cli
    from speculators.train.config import TrainConfig

    setup = cli.setup_metric_logger

    def setup_and_record(*a: Any, **k: Any) -> None:  # speculators' logging config replaces earlier handlers
        setup(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(records)

    cli.setup_metric_logger = setup_and_record
    cfg = TrainConfig.resolve(args)
    cli.main(cfg)
    return cfg


def export(ckpt: Path, target: str, out: Path) -> dict:
    """``out/``: config.json and model.safetensors of the highest epoch speculators wrote (its checkpointer's rule),
    the verifier named by the target's local path. Returns the config."""
    epochs = [int(d.name) for d in ckpt.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()]
    if not epochs:
        raise SystemExit(f"{ckpt}: no checkpoint")
    checkpoint = ckpt / str(max(epochs))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy2(checkpoint / "model.safetensors", out / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = target
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return config


def effective_settings(cfg: Any, head: dict, warmup: int, lrs: list) -> dict:
    """What speculators 0.9.0 does with this run, from its resolved config and source (train/optimizers.py,
    trainer.py, losses/, models/eagle3/)."""
    a, layer = cfg.flatten(), head["transformer_layer_config"]
    adamw = f"AdamW: lr {a['lr']}, weight_decay {a['weight_decay']}, betas (0.9, 0.999), eps 1e-8"
    return {
        "optimizer": adamw + " on every trainable parameter" if a["optimizer"] == "adamw" else
        f"Muon on the 2-D matrices but embeddings and heads: lr {a['muon_lr']}, momentum {a['muon_momentum']}, "
        f"weight_decay {a['muon_weight_decay']}, ns_steps {a['muon_ns_steps']}, {a['muon_adjust_lr_fn']}; "
        f"{adamw} on the rest",
        "lr": a["lr"], "warmup_steps": warmup, "lr_per_step": lrs, "grad_clip": 1.0,
        "schedule": f"transformers' get_{a['scheduler_type']}_schedule_with_warmup over --max-steps: warm-up from 0, "
                    "then down to 0; one per optimizer",
        "ttt_steps": a["ttt_steps"], "step_weights": [a["ttt_step_loss_decay"] ** i for i in range(a["ttt_steps"])],
        "loss": f"{a['loss_fn']} ({a['loss_implementation']}): KL(target || draft) per position over the draft ids, "
                "the target's softmax of its head rows for them; per TTT step sum(loss * mask) / (sum(mask) + 1e-5) "
                "over the packed row; the total sums the steps' weighted losses; no top-1-in-vocabulary gate",
        "alignment": "position t takes token t+1's embedding and token t's states, predicts token t+2, gated on "
                     "loss_mask[t+1]; TTT step i+1 takes the true tokens shifted by i+1 (teacher forcing) and step "
                     "i's normed output",
        "draft_vocab_size": head["draft_vocab_size"], "vocab_size": layer["vocab_size"],
        "aux_layer_ids": head["eagle_aux_hidden_state_layer_ids"],
        "norms": {k: head[k] for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")},
        "draft_layers": layer["num_hidden_layers"], "sliding_window": layer.get("sliding_window"),
        "frozen": "embedding and lm_head (the target's rows for the draft ids)", "attention": a["draft_attn_impl"],
        "dtype": a["hidden_states_dtype"], "seq_len": a["total_seq_len"], "seed": a["seed"],
        "checkpoint_dtype": head.get("dtype"),
    }


def write_json(path: Path, value: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value, indent=2))
    os.replace(path.with_suffix(".tmp"), path)


def prepare(job: dict, out: Path) -> dict:
    """Rows, states, vocabulary and speculators' command line. speculators needs a validation split
    (--train-data-ratio strictly inside (0, 1)): one extra row, a copy of the last, is its smallest one."""
    from transformers import AutoModelForCausalLM

    from speculators.models.utils import resolve_target_layer_ids

    rows, data, start = read_rows(job["tokens"], job["max_length"]), out / "data", time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    layer_ids = aux_layer_ids(model.config.num_hidden_layers)
    if resolve_target_layer_ids(None, job["target"]) != layer_ids:  # the ids its trainer will assume
        raise SystemExit(f"aux ids {layer_ids} are not speculators' {resolve_target_layer_ids(None, job['target'])}")
    write_dataset(rows + rows[-1:], data)
    size, tokens = write_features(model, rows + rows[-1:], data, layer_ids)
    capture_s = time.perf_counter() - start
    size -= (data / "hidden_states" / f"hs_{len(rows)}.safetensors").stat().st_size  # the copy is not trained
    ratio = (len(rows) + 0.5) / (len(rows) + 1)  # int((N + 1) * ratio) = N rows train
    vocab = draft_vocab = None
    if job["vocab"]:
        vocab = write_vocab(job["vocab"], out / "vocab")
    elif job.get("draft_vocab"):
        draft_vocab = job["draft_vocab"]
        write_token_freq(rows, data / "token_freq.pt")
    lengths = [len(r["input_ids"]) for r in rows]
    packed, epochs = packing(lengths, job["seq_len"], job["seed"], job["total_steps"])
    return {"args": train_args(job, data, epochs, vocab, draft_vocab, ratio), "layer_ids": layer_ids,
            "feature_bytes": size, "feature_tokens": tokens - len(rows[-1]["input_ids"]), "capture_s": capture_s,
            "epochs": epochs, "ratio": ratio,
            "tokens_trained": sum(min(job["seq_len"], sum(lengths[i] for i in batch)) for batch in packed)}


def summarise(job: dict, run: dict, cfg: Any, head: dict, steps: list[dict], notes: list[str]) -> dict:
    """result.json from the run, speculators' per-step records and its head."""
    from types import SimpleNamespace

    from speculators.train.trainer import _resolve_scheduler_steps

    a = cfg.flatten()
    warmup, _ = _resolve_scheduler_steps(SimpleNamespace(num_epochs=a["epochs"], **{k: a[k] for k in (
        "max_steps", "scheduler_total_steps", "scheduler_warmup_steps", "scheduler_warmup_ratio")}), 0)
    step_s = [s["profile"]["step_ms"] / 1000 for s in steps]
    train_s, trained = sum(step_s), run["tokens_trained"]
    return {
        "speculators": importlib.metadata.version("speculators"), "job": job, "capture_s": round(run["capture_s"], 3),
        "train_s": round(train_s, 3),
        "train_s_source": "sum of speculators' per-step profile step_ms (--log-freq 1): from the end of the previous "
                          "step's optimizer and scheduler step (the epoch's start for its first step) to the end of "
                          "this one's, so the loader's wait, the previous step's metric logging, forward, backward, "
                          "clipping and optimizer; without process start, model set-up, validation and checkpoints",
        "data_wait_s": round(sum(s["profile"]["queue_ms"] for s in steps) / 1000, 3),
        "data_wait_source": "sum of profile queue_ms (waiting for the batch)",
        "train_process_s": round(run["process_s"], 3), "steps": len(steps), "step_s": [round(s, 3) for s in step_s],
        "steady_step_s": round(statistics.median(step_s[1:]), 3) if len(step_s) > 1 else None,
        "tokens_trained": trained, "tokens_per_s": round(trained / train_s, 1) if train_s else None,
        "tokens_counted_by_speculators": round(sum(s["profile"]["tokens_per_s"] * s["profile"]["step_ms"] / 1000
                                                   for s in steps)),
        "feature_bytes": run["feature_bytes"], "feature_tokens": run["feature_tokens"],
        "bytes_per_token": round(run["feature_bytes"] / max(1, run["feature_tokens"]), 1),
        "loss": [s["train"].get("loss") for s in steps],
        "full_acc": [[s["train"].get(f"full_acc_{i}") for i in range(job["ttt_steps"])] for s in steps],
        "epochs": run["epochs"], "config": effective_settings(cfg, head, warmup, [s.get("lr") for s in steps]),
        "speculators_args": run["args"],
        "notes": [
            *notes,
            "flags for the CPU: --hidden-states-dtype float32 (its GPU default bf16 is also the autocast dtype; "
            "autocast is off here, so the draft trains in fp32), --loss-implementation eager (the fused losses need "
            "Triton), --draft-attn-impl sdpa (simple_flex_attention is compiled only with CUDA), --on-missing raise "
            "(no vLLM endpoint is ever contacted), --num-workers from the job (default 12)",
            f"states captured with a transformers forward and hooks in fp32 (upstream: vLLM's extract_hidden_states, "
            f"bf16): the residual entering blocks {run['layer_ids']} and the final state before the norm",
            f"--epochs {run['epochs']}, the fewest that hold {job['total_steps']} steps under its own packing: its "
            "epoch loop does not stop at --max-steps and would run one more step in each further epoch",
            f"validation split: one extra row, a copy of the last training row (--train-data-ratio {run['ratio']!r}; "
            "it accepts no ratio of 1), validated after each epoch outside the step times",
            "rows are trained as given (upstream prepare-data would drop a row with no masked token)",
            "checkpoints are saved in bf16, as speculators always does; vllm/ is the last epoch's",
        ] + ([] if len(steps) == job["total_steps"] else
             [f"speculators logged {len(steps)} steps, the job asked for {job['total_steps']}"]),
    }


def main(job_path: str) -> int:
    job = load_job(job_path)
    out = Path(job["out"])
    for stale in ("data", "vocab", "ckpt", "logs", "vllm"):  # a rerun starts afresh (no resume, no old rows)
        shutil.rmtree(out / stale, ignore_errors=True)
    for name in ("metrics.jsonl", "result.json"):
        (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update({"OMP_NUM_THREADS": str(job["threads"]), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"})
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    os.chdir(out)  # speculators' relative defaults land here (the job's own paths are absolute by now)
    run = prepare(job, out)
    notes = cpu_patches()
    records = MetricRecords(out / "metrics.jsonl")
    start = time.perf_counter()
    cfg = train(run["args"], records)
    run["process_s"] = time.perf_counter() - start
    head = export(out / "ckpt", job["target"], out / "vllm")
    if head["eagle_aux_hidden_state_layer_ids"] != run["layer_ids"]:
        raise SystemExit(f"the head's aux ids {head['eagle_aux_hidden_state_layer_ids']} are not the captured ones")
    write_json(out / "result.json", summarise(job, run, cfg, head, [r for r in records.records if "train" in r],
                                              notes))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1]))
