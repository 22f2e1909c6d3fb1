"""Stage 2: train a draft head on precomputed features with accelerate (DDP, or DeepSpeed ZeRO).

Read top to bottom: load (features, frozen target parts, head) -> resume from ``latest`` ->
for each optimizer step: micro-batches -> loss -> backward -> clip -> step -> log -> validate ->
checkpoint -> at the end, write the HF-style head directory.

Launch one process with ``mtp-train train RECIPE``; several on CPU with
``ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N -m mtp_train.cli train RECIPE`` (gloo).
Rank r takes batches r, r+W, ... of each epoch's seeded order, so the global batch is
``W * grad_accum * batch_tokens`` tokens, and the data position is a function of the step.

SIGUSR1 or SIGTERM (a SLURM time-limit warning or a preemption) asks for a stop: at the end of the
current optimizer step every rank agrees on it, a checkpoint is written, and the process exits with
status 75 (``EXIT_STOPPED``). Rerunning the command resumes from that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.io import crash_point, pause_point, write_atomic
from mtp_train.models.checkpoint import read_layer
from mtp_train.progress import Progress
from mtp_train.recipe import Recipe
from mtp_train.threads import set_threads, warn_if_oversubscribed
from mtp_train.train.checkpoint import (begin_checkpoint, finish_checkpoint, head_is_complete, load_checkpoint,
                                        load_optimizer_shard, save_head, save_optimizer_shard)
from mtp_train.train.data import Batch, load_batch, plan_batches
from mtp_train.train.loss import LossWeights, head_loss, simulated_tau
from mtp_train.train.ttt import ttt_loss
from mtp_train.train.vocab import aux_indices, draft_vocab_size, frequent_tokens
from mtp_train.features.manifest import text_fingerprint
from mtp_train.features.reader import FeatureReader


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; run again to resume
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Set by SIGUSR1/SIGTERM; the trainer checks it between optimizer steps, never inside one."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        self.signal = signum

    def agreed(self, accelerator) -> bool:
        """True on every rank when any rank was signalled, so that all ranks stop after the same step."""
        flag = torch.tensor(1.0 if self.signal is not None else 0.0, device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum") > 0) if accelerator.num_processes > 1 else bool(flag)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    kwargs: dict[str, Any] = {"mixed_precision": recipe.train.mixed_precision}
    if recipe.train.engine == "deepspeed":
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29511"}.items():
            os.environ.setdefault(key, value)  # not launched: one process (DeepSpeed would look for MPI)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=recipe.train.zero_stage, gradient_accumulation_steps=recipe.train.grad_accum,
            gradient_clipping=recipe.train.grad_clip,
        )
    if not torch.cuda.is_available():
        if recipe.train.engine == "deepspeed":
            import deepspeed.ops

            # DeepSpeed's shared-memory all-reduce compiles C++ for minutes on first use; gloo does the job.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        else:
            kwargs["cpu"] = True  # (with cpu=True, accelerate would silently drop DeepSpeed)
            # accelerate imports DeepSpeed whenever it is installed (unwrap_model checks for its engine), and the
            # import warns "Setting accelerator to CPU ... unable to detect it" when it finds no GPU. Naming the CPU
            # silences that, and only here: without CUDA, under DDP, where DeepSpeed does no work.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # gloo, since NCCL needs CUDA
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(**kwargs)
    if recipe.train.engine == "deepspeed":  # batches are packed by tokens, so one "sample" per micro-batch
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    return accelerator


def _lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def loss_weights(recipe: Recipe) -> LossWeights:
    t = recipe.train
    return LossWeights(t.w_hidden, t.w_logits, t.unroll, t.unroll_decay, t.teacher)


def heldout_batches(reader: FeatureReader, batch_tokens: int, aux: tuple[int, ...] = ()) -> Iterator[Batch]:
    """The held-out sequences, 16 per batch, in stored order (with the stored layers ``aux`` as ``Batch.aux``)."""
    refs = reader.heldout
    for i in range(0, len(refs), 16):
        yield load_batch(reader, refs[i : i + 16], batch_tokens, torch.float32, aux=aux)


def objective(head, frozen, batch: Batch, weights: LossWeights, forward=None):
    """The head's training loss and per-step metrics: training-time test for ``eagle3``, else ``head_loss``."""
    return (ttt_loss if head.spec.kind == "eagle3" else head_loss)(head, frozen, batch, weights, forward)


@torch.no_grad()
def validate(head, frozen, batches: Iterable[Batch], weights: LossWeights, forward=None) -> dict[str, Any]:
    """Teacher-forced loss and top-1 accuracy per unrolled step over ``batches``.

    ``forward`` replaces the head's own forward (the eval passes the runtime's paged implementation).
    """
    was_training = head.training
    head.eval()
    sums = [[0.0, 0, 0] for _ in range(weights.unroll)]  # loss*count, correct, count
    for batch in batches:
        _, metrics = objective(head, frozen, batch.to(frozen.embed_weight.device), weights, forward=forward)
        for s, m in zip(sums, metrics):
            s[0] += float(m.loss) * m.count
            s[1] += m.correct
            s[2] += m.count
    head.train(was_training)
    acc = [c / n if n else 0.0 for _, c, n in sums]
    return {
        "val_loss": [round(l / n, 5) if n else None for l, _, n in sums],
        "val_top1": [round(a, 5) for a in acc],
        "val_tau": round(simulated_tau(acc), 4),
        "val_tokens": sums[0][2],
    }


def _trim_log(path: Path, step: int) -> None:
    """Keep the records of steps the resumed checkpoint has seen; a line torn by a kill is dropped."""
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept).encode())


def _log(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def run_train(recipe: Recipe) -> Path:
    start = time.perf_counter()
    set_threads(recipe.threads)
    out = recipe.head_dir()
    reader = FeatureReader(recipe.features_dir, target=recipe.target.path)
    frozen = FrozenTarget.load(recipe.target.path)
    if reader.manifest.layers[-1] != frozen.cfg.num_layers - 1:
        raise UserError(f"{recipe.features_dir}: the last stored layer must be the target's last layer")
    eagle3 = recipe.head.kind == "eagle3"
    aux = aux_indices(reader, recipe.head.aux_layers, frozen.cfg) if eagle3 else ()
    spec = head_spec(recipe.head.kind, recipe.head.num_layers, frozen.cfg, reader.manifest.fingerprint["target"],
                     recipe.head.convention, tuple(reader.manifest.layers[i] + 1 for i in aux),
                     draft_vocab_size(recipe.head.draft_vocab, frozen.cfg.vocab_size))
    train_key = text_fingerprint(json.dumps(
        {"recipe_train": recipe.train.model_dump(mode="json"), "head": recipe.head.model_dump(mode="json"),
         "seed": recipe.seed, "features": reader.manifest.fingerprint}, sort_keys=True))
    if head_is_complete(out, train_key):
        print(f"train: {out} is complete and matches the recipe; skipped", file=sys.stderr)
        return out

    torch.manual_seed(recipe.seed)
    head = build_head(spec)
    if eagle3:  # its vocabulary: the most frequent assistant tokens; its lm_head starts as their frozen rows
        ids = frequent_tokens(reader, spec.draft_vocab, frozen.cfg.vocab_size)
        head.draft_ids.copy_(ids)
        head.lm_head.weight.data.copy_(frozen.lm_head_weight[ids])
    if recipe.head.init == "target_last_layer" and spec.kind == "mtp":  # not eagle: see HeadConfig.init
        state = read_layer(recipe.target.path, frozen.cfg.num_layers - 1, list(_layer_suffixes(head)), frozen.cfg)
        for layer in head.layers:
            layer.load_state_dict({k: v for k, v in state.items() if k in layer.state_dict()}, strict=False)
    t = recipe.train
    optimizer = torch.optim.AdamW(head.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    accelerator = _accelerator(recipe)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    frozen = frozen.to(device)  # the head goes there in accelerator.prepare; the frozen parts and batches here
    per_epoch = len(plan_batches(reader.train, t.batch_tokens, recipe.seed, 0)) // (world * t.grad_accum)
    if per_epoch == 0:
        raise UserError(f"{recipe.features_dir}: too few training sequences for {world} process(es) x "
                        f"{t.grad_accum} micro-batches; lower train.batch_tokens")
    total = t.max_steps or max(1, int(t.epochs * per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(t.warmup_steps, total))
    ckpt_root = recipe.checkpoints_dir
    zero = recipe.train.engine == "deepspeed"  # optimizer state partitioned over the ranks
    saved = load_checkpoint(ckpt_root, head, scheduler)
    step = saved[1]["step"] if saved else 0
    # The scheduler stays unwrapped: accelerate's wrapper would step it once per process.
    model, optimizer = accelerator.prepare(head, optimizer)
    if saved:
        _restore_optimizer(optimizer, load_optimizer_shard(*saved, rank, world, zero), zero)
    log_path = recipe.train_log
    if accelerator.is_main_process:
        recipe.output_dir.mkdir(parents=True, exist_ok=True)
        if log_path.exists():
            _trim_log(log_path, step)
    run = _wandb(recipe, accelerator.is_main_process)
    weights = loss_weights(recipe)
    if accelerator.is_main_process:
        epoch_tokens = sum(r.stop - r.start for r in reader.train)
        print(f"train: {spec.kind} head, {sum(p.numel() for p in head.parameters()):,} parameters, "
              f"{len(reader.train)} train / {len(reader.heldout)} held-out sequences, {world} process(es), "
              f"{total} steps = {total / per_epoch:.2f} epochs of {per_epoch} steps ({epoch_tokens:,} training tokens, "
              f"at most {world * t.grad_accum * t.batch_tokens:,} per step)"
              + (f", resuming at step {step}" if step else ""), file=sys.stderr)
    warn_if_oversubscribed("train", accelerator.is_main_process)
    progress = Progress("train", total, "steps", initial=step, enabled=accelerator.is_main_process)
    plans: dict[int, list[list[int]]] = {}

    def load(at_step: int, micro: int):
        """This rank's micro-batch ``micro`` of optimizer step ``at_step`` (the data position is the step)."""
        epoch, index = divmod(at_step, per_epoch)
        if epoch not in plans:
            plans[epoch] = plan_batches(reader.train, t.batch_tokens, recipe.seed, epoch)
        plan = plans[epoch]  # a reshuffled epoch can cut a batch or two fewer than epoch 0: wrap around
        ids = plan[((index * t.grad_accum + micro) * world + rank) % len(plan)]
        return lambda: load_batch(reader, [reader.train[i] for i in ids], t.batch_tokens, torch.float32,
                                  every_token=t.loss_tokens == "all", aux=aux)

    def save_checkpoint(step: int, epoch: int, index: int) -> None:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            begin_checkpoint(ckpt_root, step)
        accelerator.wait_for_everyone()
        if zero or accelerator.is_main_process:
            save_optimizer_shard(ckpt_root, step, rank, _optimizer_state(optimizer, zero))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            finish_checkpoint(ckpt_root, step, accelerator.unwrap_model(model), scheduler,
                              {"epoch": epoch, "batch_in_epoch": index + 1, "per_epoch": per_epoch},
                              world if zero else 1, t.keep_checkpoints)
        accelerator.wait_for_everyone()

    stop = StopRequest()
    # The next micro-batch loads on a background thread while the current one trains.
    prefetch = ThreadPoolExecutor(max_workers=1)
    pending = prefetch.submit(load(step, 0)) if step < total else None
    while step < total:
        epoch, index = divmod(step, per_epoch)
        step_loss, step_metrics, step_tokens = 0.0, [[0, 0] for _ in range(t.unroll)], 0
        for micro in range(t.grad_accum):
            batch = pending.result().to(device)
            following = (step, micro + 1) if micro + 1 < t.grad_accum else (step + 1, 0)
            pending = prefetch.submit(load(*following)) if following[0] < total else None
            sync = micro == t.grad_accum - 1
            # DeepSpeed counts micro-batches itself (accumulate); DDP skips the all-reduce until the last one.
            with accelerator.accumulate(model) if zero else accelerator.no_sync(model) if not sync else nullcontext():
                loss, metrics = objective(head, frozen, batch, weights, forward=model)
                accelerator.backward(loss if zero else loss / t.grad_accum)  # DeepSpeed divides by itself
            step_loss += float(loss.detach()) / t.grad_accum
            step_tokens += batch.num_tokens
            for s, m in zip(step_metrics, metrics):
                s[0] += m.correct
                s[1] += m.count
        accelerator.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        mean_loss = float(accelerator.reduce(torch.tensor(step_loss, device=device), reduction="mean"))
        record: dict[str, Any] = {"step": step, "loss": round(mean_loss, 6), "lr": scheduler.get_last_lr()[0],
                                  "top1": [round(c / n, 4) if n else None for c, n in step_metrics]}
        if step % t.val_every == 0 or step == total:
            record.update(validate(accelerator.unwrap_model(model), frozen, heldout_batches(reader, t.batch_tokens, aux),
                                   weights))
        if accelerator.is_main_process:
            _log(log_path, record)
            if run is not None:
                run.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=step)
        progress.update(1, tokens=step_tokens * world, note=f"loss {mean_loss:.3f}")  # other ranks: about as many
        saved_now = step % t.save_every == 0 or step == total
        if saved_now:
            save_checkpoint(step, epoch, index)
            crash_point("train", step)
            pause_point("train", step)
        if step < total and stop.agreed(accelerator):
            if not saved_now:
                save_checkpoint(step, epoch, index)
            stop.restore()
            progress.close()
            prefetch.shutdown(cancel_futures=True)
            if accelerator.is_main_process:
                why = signal.Signals(stop.signal).name if stop.signal else "a signal on another rank"
                print(f"train: stopped by {why} after step {step}; checkpoint {ckpt_root / 'latest'} written; "
                      f"run again to resume (exit status {EXIT_STOPPED})", file=sys.stderr)
                if run is not None:
                    run.finish()
            sys.exit(EXIT_STOPPED)
    stop.restore()
    progress.close()
    prefetch.shutdown()
    # Every rank's weight digest, so that anyone can check the replicas stayed identical.
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in head.parameters())).digest()
    digests = accelerator.gather(torch.tensor(list(digest), dtype=torch.int64, device=device))
    rank_digests = [bytes(d.tolist()).hex() for d in digests.view(world, -1).cpu()]
    if accelerator.is_main_process:
        final = validate(accelerator.unwrap_model(model), frozen, heldout_batches(reader, t.batch_tokens, aux), weights)
        save_head(out, accelerator.unwrap_model(model), {"training_fingerprint": train_key, "steps": step,
                                                        "validation": final, "rank_weight_sha256": rank_digests})
        print(f"train: {spec.kind} head -> {out}; held-out top-1 per step {final['val_top1']}, simulated tau "
              f"{final['val_tau']}, {time.perf_counter() - start:.0f}s", file=sys.stderr)
        if run is not None:
            run.finish()
    accelerator.wait_for_everyone()
    return out


def _optimizer_state(optimizer, zero: bool) -> dict[str, Any]:
    """This rank's optimizer state, tensors only. Under ZeRO: the base AdamW's state over this rank's
    flat partition, and that partition's fp32 master weights."""
    if not zero:
        return optimizer.state_dict()
    partitioned = optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    return {"base": partitioned.optimizer.state_dict(),
            "fp32": [t.detach().clone() for t in partitioned.single_partition_of_fp32_groups]}


def _restore_optimizer(optimizer, saved: dict[str, Any], zero: bool) -> None:
    if not zero:
        optimizer.load_state_dict(saved)
        return
    partitioned = optimizer.optimizer
    partitioned.optimizer.load_state_dict(saved["base"])
    for current, old in zip(partitioned.single_partition_of_fp32_groups, saved["fp32"], strict=True):
        current.data.copy_(old)


def _layer_suffixes(head) -> set[str]:
    return {name.split(".", 2)[2] for name in head.state_dict() if name.startswith("layers.")}


def _wandb(recipe: Recipe, main: bool):
    mode = os.environ.get("WANDB_MODE", recipe.train.wandb_mode)
    if not main or mode == "disabled":
        return None
    import wandb

    return wandb.init(project=recipe.train.wandb_project, mode=mode, dir=str(recipe.output_dir),
                      config=recipe.model_dump(mode="json"), name=f"{recipe.output_dir.name}-{recipe.head.kind}")
