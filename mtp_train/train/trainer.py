"""Stage 2: train a draft head on precomputed features with accelerate (DDP, or DeepSpeed ZeRO).

``run_train`` reads top to bottom: read the inputs (features, frozen target parts, the head's spec) -> skip a head
already complete -> set up (head, optimizer, accelerator, resume from ``latest``) -> for each optimizer step:
micro-batches -> loss -> backward -> clip -> step -> log -> validate -> checkpoint -> stop if asked -> at the end,
write the HF-style head directory. ``Trainer`` holds the run's state and names each of those steps.

Launch one process with ``mtp-train train RECIPE``; several on CPU with ``ACCELERATE_USE_CPU=1 torchrun
--nproc_per_node N -m mtp_train.cli train RECIPE`` (gloo). Rank r takes batches r, r+W, ... of each epoch's seeded
order, so the global batch is ``W * grad_accum * batch_tokens`` tokens, and the data position is a function of the step.

SIGUSR1 or SIGTERM (a SLURM time-limit warning or a preemption) asks for a stop: at the end of the current
optimizer step every rank agrees on it, a checkpoint is written, and the process exits with status 75
(``EXIT_STOPPED``). Rerunning the command resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from mtp_train.errors import UserError
from mtp_train.heads import AUX_KINDS, DraftHead, HeadSpec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.io import crash_point, pause_point
from mtp_train.lock import exclusive, rank_lock
from mtp_train.progress import Progress
from mtp_train.recipe import Recipe
from mtp_train.threads import leave_signals_to_main_thread, set_threads, warn_if_oversubscribed
from mtp_train.train.checkpoint import (begin_checkpoint, finish_checkpoint, head_identity, head_is_complete,
                                        load_checkpoint, load_optimizer_shard, save_head, save_optimizer_shard,
                                        training_fingerprint)
from mtp_train.train.data import Batch, BatchPlan, load_batch, plan_batches, plan_rank
from mtp_train.train.initial import initial_head
from mtp_train.train.distributed import (EXIT_STOPPED, StopRequest, lr_factor, make_accelerator, optimizer_state,
                                         rank_digests, restore_optimizer, train_precision)
from mtp_train.train.loss import LossWeights, StepMetrics
from mtp_train.train.objective import heldout_batches, loss_weights, objective, validate
from mtp_train.train.optimizer import build_optimizer
from mtp_train.train.records import append_record, logged_tokens, start_wandb, trim_log
from mtp_train.train.recipe_checks import init_head_spec, recipe_head_spec
from mtp_train.train.vocab import aux_indices
from mtp_train.features.online import Features, OnlineFeatures, open_features
from mtp_train.train.online import OnlineScoring

if TYPE_CHECKING:
    from accelerate import Accelerator


def run_train(recipe: Recipe, tau_probe: Callable[[Recipe, torch.device], Any] | None = None) -> Path:
    """Train ``recipe``'s head, resuming from its latest checkpoint, and write the head directory (returned).
    ``tau_probe`` starts rank 0's τ probe where ``train.tau_every`` asks for one (``eval.tau_probe``).

    A head already complete for this recipe and these features is kept as it is. A stop request (SIGUSR1 or
    SIGTERM) ends the process with status ``EXIT_STOPPED`` after a checkpoint of the current step."""
    started = time.perf_counter()
    set_threads(recipe.threads)
    inputs = TrainInputs.read(recipe)
    if head_is_complete(recipe.head_dir(), inputs.train_key):
        print(f"train: {recipe.head_dir()} is complete and matches the recipe; skipped", file=sys.stderr)
        return recipe.head_dir()
    with exclusive(rank_lock(recipe.checkpoints_dir), f"train ({recipe.head.kind} head)"):
        return _train(Trainer.setup(inputs, started, tau_probe))


def _train(trainer: Trainer) -> Path:
    """The loop: steps until the last, validated, logged and checkpointed as the recipe says; a stop on request."""
    while trainer.step < trainer.total:
        result = trainer.train_step()
        if trainer.validation_due():
            result.record.update(trainer.validate())
        if trainer.tau_due():
            result.record.update(trainer.probe_tau())
        trainer.log(result)
        checkpointed = trainer.checkpoint_due()
        if checkpointed:
            trainer.save()
            crash_point("train", trainer.step)  # test hook: die right after a checkpoint
        pause_point("train", trainer.step)  # test hook: stop at the end of a step, before a stop request is read
        if trainer.stop_agreed():
            if not checkpointed:
                trainer.save()
            trainer.stop()
            sys.exit(EXIT_STOPPED)
    return trainer.finish()


@dataclass(frozen=True)
class TrainInputs:
    """What a run trains on, read before anything is built: the features, the frozen target parts (loaded on the CPU),
    the head's spec, the stored layers an eagle3 head reads (``aux``: indices into the stored layers, else empty) and
    ``train_key``, the fingerprint of the training settings and the features a finished head records."""

    recipe: Recipe
    reader: Features
    frozen: FrozenTarget
    spec: HeadSpec  # (head.init_from: that head's)
    aux: tuple[int, ...]
    train_key: str  # (head.init_from: that head's identity too)

    @classmethod
    def read(cls, recipe: Recipe) -> TrainInputs:
        reader, frozen = open_features(recipe), FrozenTarget.load(recipe.target.path)
        if reader.manifest.layers[-1] != frozen.cfg.num_layers - 1:
            raise UserError(f"{recipe.features_dir}: the last stored layer must be the target's last layer")
        h = recipe.head
        aux = aux_indices(reader, h.aux_layers, frozen.cfg) if h.kind in AUX_KINDS else ()
        target = reader.manifest.fingerprint["target"]
        spec = (init_head_spec(recipe, frozen.cfg, target) if h.init_from is not None else
                recipe_head_spec(recipe, frozen.cfg, target, tuple(reader.manifest.layers[i] + 1 for i in aux)))
        init = head_identity(h.init_from) if h.init_from is not None else None
        train_key = training_fingerprint(recipe, reader.manifest.fingerprint, init)
        return cls(recipe, reader, frozen, spec, aux, train_key)


@dataclass
class StepResult:
    """One optimizer step: its log record (``step``, ``loss``, ``lr``, ``top1`` per unrolled step, ``tokens`` of all
    ranks, ``step_s`` its wall time; a validation adds its metrics), the loss unrounded and this rank's tokens."""

    record: dict[str, Any]
    loss: float
    tokens: int


@dataclass
class Trainer:
    """One run's state from set-up to the head directory. ``step`` counts the optimizer steps done; ``head`` is the
    module itself and ``model`` the same head as accelerate prepared it (DDP, or a DeepSpeed engine). The loop's own
    machinery (progress line, stop request, loading thread and its pending micro-batch) starts last in ``setup``."""

    recipe: Recipe
    reader: Features
    frozen: FrozenTarget  # on the accelerator's device
    spec: HeadSpec
    aux: tuple[int, ...]
    train_key: str
    head: DraftHead
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # accelerate's wrapper
    scheduler: LambdaLR  # unwrapped: accelerate's wrapper would step it once per process
    accelerator: Accelerator
    weights: LossWeights
    per_epoch: int  # optimizer steps per epoch
    total: int  # optimizer steps in the run
    step: int
    wandb_run: Any  # a wandb run on rank 0 unless disabled, else None
    started: float  # time.perf_counter() when run_train began
    plans: dict[int, list[BatchPlan]] = field(default_factory=dict)  # epoch -> this rank's lanes of batches
    online: OnlineScoring | None = None  # the target beside the head (precompute.mode: online)
    tau: Any = None  # rank 0's held-out decoding with the head as it stands (train.tau_every): a TauProbe
    seen: int = 0  # training tokens of all ranks up to ``step`` (from the log on a resume)
    last_tau: float | None = None  # the latest probe's τ, for the progress line
    progress: Progress = field(init=False)
    stop_request: StopRequest = field(init=False)
    prefetch: ThreadPoolExecutor = field(init=False)  # the next micro-batch loads here while the current one trains
    pending: Future[Batch] | None = field(init=False)

    @classmethod
    def setup(cls, inputs: TrainInputs, started: float, tau_probe: Callable[..., Any] | None = None) -> Trainer:
        """Build the head, optimizer, schedule and accelerator, resume from ``latest`` when there is one (the log
        trimmed to its step), announce the run and start loading its first micro-batch."""
        recipe, reader, t = inputs.recipe, inputs.reader, inputs.recipe.train
        accelerator = make_accelerator(recipe)
        world = accelerator.num_processes
        torch.manual_seed(recipe.seed)
        total = lambda counts: accelerator.reduce(counts.to(accelerator.device), "sum").cpu()  # noqa: E731
        head = initial_head(recipe, inputs.spec, inputs.frozen, reader, accelerator.process_index, world, total)
        optimizer = build_optimizer(head, t.optimizer, t.lr, t.weight_decay)
        frozen = inputs.frozen.to(accelerator.device)  # the head goes there in prepare; frozen parts, batches here
        per_epoch = len(plan_batches(reader.train, t.batch_tokens, recipe.seed, 0)) // (world * t.grad_accum)
        if per_epoch == 0:
            raise UserError(f"{recipe.features_dir}: too few training sequences for {world} process(es) x "
                            f"{t.grad_accum} micro-batches; lower train.batch_tokens")
        total = t.max_steps or max(1, int(t.epochs * per_epoch))
        scheduler = LambdaLR(optimizer, lr_factor(t.warmup_steps, total, t.lr_schedule))
        saved = load_checkpoint(recipe.checkpoints_dir, head, scheduler)
        step = saved[1]["step"] if saved else 0
        model, optimizer = accelerator.prepare(head, optimizer)  # not the scheduler (see its field)
        zero = t.engine == "deepspeed"
        if saved:
            restore_optimizer(optimizer, load_optimizer_shard(*saved, accelerator.process_index, world, zero,
                                                                  t.optimizer), zero)
        if accelerator.is_main_process:
            recipe.output_dir.mkdir(parents=True, exist_ok=True)
            if recipe.train_log.exists():
                trim_log(recipe.train_log, step)
        trainer = cls(recipe, reader, frozen, inputs.spec, inputs.aux, inputs.train_key, head, model, optimizer,
                      scheduler, accelerator, loss_weights(recipe), per_epoch, total, step,
                      start_wandb(recipe, accelerator.is_main_process), started)
        if t.tau_every and tau_probe is not None and accelerator.is_main_process:
            trainer.seen = logged_tokens(recipe.train_log, step)
            trainer.tau = tau_probe(recipe, accelerator.device)
        if isinstance(reader, OnlineFeatures):  # every rank at this point: a TP group scores together
            trainer.online = OnlineScoring.start(recipe, reader, accelerator, per_epoch)
        if accelerator.is_main_process:
            trainer._announce()
        warn_if_oversubscribed("train", accelerator.is_main_process)
        trainer.progress = Progress("train", total, "steps", initial=step, enabled=accelerator.is_main_process)
        trainer.stop_request = StopRequest()
        trainer.prefetch = ThreadPoolExecutor(max_workers=1, initializer=leave_signals_to_main_thread)
        trainer.pending = trainer._submit(step, 0) if step < total else None
        return trainer

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def zero(self) -> bool:
        """DeepSpeed ZeRO: the optimizer state is partitioned over the ranks, and DeepSpeed accumulates itself."""
        return self.recipe.train.engine == "deepspeed"

    def _announce(self) -> None:
        t, reader, world = self.recipe.train, self.reader, self.accelerator.num_processes
        epoch_tokens = reader.train.num_tokens
        print(f"train: {self.spec.kind} head, {sum(p.numel() for p in self.head.parameters()):,} parameters, "
              f"{len(reader.train)} train / {len(reader.heldout)} held-out sequences, {world} process(es), "
              f"{self.total} steps = {self.total / self.per_epoch:.2f} epochs of {self.per_epoch} steps "
              f"({epoch_tokens:,} training tokens, at most {world * t.grad_accum * t.batch_tokens:,} per step)"
              + (f", resuming at step {self.step}" if self.step else ""), file=sys.stderr)

    def _loader(self, step: int, micro: int) -> Callable[[], Batch]:
        """What loads this rank's micro-batch ``micro`` of optimizer step ``step`` (the data position is the step).
        The batch plan is made here, on the calling thread; the returned function reads the features."""
        t, reader, aux = self.recipe.train, self.reader, self.aux
        epoch, index = divmod(step, self.per_epoch)
        if epoch not in self.plans:  # this rank's own windows of the epoch, one lane per micro-batch
            where = (self.accelerator.process_index, self.accelerator.num_processes, t.grad_accum)
            self.plans = {epoch: plan_rank(reader.train, t.batch_tokens, self.recipe.seed, epoch, *where)}
        plan = self.plans[epoch][micro]  # a lane can be a batch or two shorter than per_epoch: wrap around
        ids = plan[index % len(plan)]
        return lambda: load_batch(reader, [reader.train[i] for i in ids], t.batch_tokens, torch.float32,
                                  every_token=t.loss_tokens == "all", aux=aux)

    def _next_batch(self, micro: int) -> Batch:
        """Micro-batch ``micro`` of this step on the device, once the thread has loaded it; the thread goes on to
        the one after (the next step's first after the last micro-batch, none after the run's last)."""
        batch = self.pending.result().to(self.device)
        following = (self.step, micro + 1) if micro + 1 < self.recipe.train.grad_accum else (self.step + 1, 0)
        self.pending = self._submit(*following) if following[0] < self.total else None
        return batch

    def _submit(self, step: int, micro: int) -> Future[Batch]:
        """Start loading micro-batch ``micro`` of step ``step`` on the thread; online, the shards its step reads are
        scored first, here on the calling thread (a TP group's ranks reach this point together)."""
        if self.online is not None and micro == 0:
            self.online.ensure(step)
        return self.prefetch.submit(self._loader(step, micro))

    def _forward_backward(self, batch: Batch, last: bool) -> tuple[torch.Tensor, list[StepMetrics]]:
        """The loss of one micro-batch (a scalar tensor) and its metrics per unrolled step, after its backward.
        ``last``: the step's last micro-batch, whose backward all-reduces the gradients under DDP."""
        accelerator, model, grad_accum = self.accelerator, self.model, self.recipe.train.grad_accum
        # DeepSpeed counts micro-batches itself (accumulate); DDP skips the all-reduce until the last one.
        with accelerator.accumulate(model) if self.zero else accelerator.no_sync(model) if not last else nullcontext():
            with self.autocast():
                loss, metrics = objective(self.head, self.frozen, batch, self.weights, forward=model)
            accelerator.backward(loss if self.zero else loss / grad_accum)  # DeepSpeed divides by itself
        return loss, metrics

    def train_step(self) -> StepResult:
        """One optimizer step over ``grad_accum`` micro-batches: gradients, clipping, AdamW, the schedule."""
        t = self.recipe.train
        started = time.perf_counter()
        step_loss, counts, tokens = 0.0, [[0, 0] for _ in range(self.weights.unroll)], 0  # [correct, count] per step
        for micro in range(t.grad_accum):
            batch = self._next_batch(micro)
            micro_loss, metrics = self._forward_backward(batch, last=micro == t.grad_accum - 1)
            step_loss += float(micro_loss.detach()) / t.grad_accum
            tokens += batch.num_tokens
            for c, m in zip(counts, metrics):
                c[0] += m.correct
                c[1] += m.count
        self.accelerator.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.seen += tokens * self.accelerator.num_processes
        mean_loss = float(self.accelerator.reduce(torch.tensor(step_loss, device=self.device), reduction="mean"))
        record: dict[str, Any] = {"step": self.step, "loss": round(mean_loss, 6), "lr": self.scheduler.get_last_lr()[0],
                                  "top1": [round(c / n, 4) if n else None for c, n in counts],
                                  "tokens": tokens * self.accelerator.num_processes,
                                  "step_s": round(time.perf_counter() - started, 4)}
        return StepResult(record, mean_loss, tokens)

    def validation_due(self) -> bool:
        return self.step % self.recipe.train.val_every == 0 or self.step == self.total

    def tau_due(self) -> bool:
        every = self.recipe.train.tau_every
        return bool(every) and (self.step % every == 0 or self.step == self.total)

    def probe_tau(self) -> dict[str, Any]:
        """Rank 0: τ and α₁ of the head as it is now on the held-out prompts (``TauProbe.measure``), with the
        training tokens so far; the other ranks go on to the next step and meet rank 0 at its collectives."""
        if self.tau is None:
            return {}
        probe = self.tau.measure(self.accelerator.unwrap_model(self.model))
        self.last_tau = probe.get("tau")
        return {**probe, "train_tokens": self.seen}

    def autocast(self) -> AbstractContextManager:
        """bf16 autocast over the head, the frozen lm_head and the loss (``train.mixed_precision: bf16``), whatever
        holds the weights: DeepSpeed's bf16 engine casts the head to bf16 beside fp32 features and frozen parts."""
        if train_precision(self.recipe) != "bf16":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def validate(self) -> dict[str, Any]:
        """The held-out metrics of the head as it is now (the module-level ``validate``'s record)."""
        batches = heldout_batches(self.reader, self.recipe.train.batch_tokens, self.aux)
        with self.autocast():
            return validate(self.accelerator.unwrap_model(self.model), self.frozen, batches, self.weights)

    def log(self, result: StepResult) -> None:
        """The step's record into the JSONL log and its scalars into wandb (rank 0); the progress line moves on."""
        if self.accelerator.is_main_process:
            append_record(self.recipe.train_log, result.record)
            if self.wandb_run is not None:
                self.wandb_run.log({k: v for k, v in result.record.items() if not isinstance(v, list)}, step=self.step)
        tau = "" if self.last_tau is None else f", tau {self.last_tau:.2f}"
        self.progress.update(1, tokens=result.tokens * self.accelerator.num_processes,  # other ranks: about as many
                             note=f"loss {result.loss:.3f}{tau}")

    def checkpoint_due(self) -> bool:
        return self.step % self.recipe.train.save_every == 0 or self.step == self.total

    def save(self) -> None:
        """Checkpoint the step just taken, every rank taking part: head, scheduler, RNG and data position from rank
        0, the optimizer state from rank 0 (DDP) or from every rank (ZeRO's partitions)."""
        accelerator, root, step = self.accelerator, self.recipe.checkpoints_dir, self.step
        epoch, index = divmod(step - 1, self.per_epoch)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            begin_checkpoint(root, step)
        accelerator.wait_for_everyone()
        if self.zero or accelerator.is_main_process:
            save_optimizer_shard(root, step, accelerator.process_index, optimizer_state(self.optimizer, self.zero))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            finish_checkpoint(root, step, accelerator.unwrap_model(self.model), self.scheduler,
                              {"epoch": epoch, "batch_in_epoch": index + 1, "per_epoch": self.per_epoch,
                               "optimizer": self.recipe.train.optimizer},
                              accelerator.num_processes if self.zero else 1, self.recipe.train.keep_checkpoints)
        accelerator.wait_for_everyone()

    def stop_agreed(self) -> bool:
        """Whether every rank agrees to stop now, on a signal; never asked after the last step, which finishes."""
        return self.step < self.total and self.stop_request.agreed(self.accelerator)

    def stop(self) -> None:
        """End the run after the stop's checkpoint: pending loads cancelled, and how to resume said on rank 0."""
        self._release(cancel_loads=True)
        if self.accelerator.is_main_process:
            signum = self.stop_request.signal
            why = signal.Signals(signum).name if signum else "a signal on another rank"
            print(f"train: stopped by {why} after step {self.step}; checkpoint "
                  f"{self.recipe.checkpoints_dir / 'latest'} written; run again to resume (exit status "
                  f"{EXIT_STOPPED})", file=sys.stderr)
            if self.wandb_run is not None:
                self.wandb_run.finish()

    def finish(self) -> Path:
        """After the last step: every rank's weight digest; on rank 0 the final validation and the head directory."""
        self._release(cancel_loads=False)
        digests = rank_digests(self.accelerator, self.head)
        out = self.recipe.head_dir()
        if self.accelerator.is_main_process:
            final = self.validate()
            save_head(out, self.accelerator.unwrap_model(self.model), {
                "training_fingerprint": self.train_key, "steps": self.step, "validation": final,
                "rank_weight_sha256": digests})
            print(f"train: {self.spec.kind} head -> {out}; held-out top-1 per step {final['val_top1']}, simulated "
                  f"tau {final['val_tau']}, {time.perf_counter() - self.started:.0f}s", file=sys.stderr)
            if self.wandb_run is not None:
                self.wandb_run.finish()
        self.accelerator.wait_for_everyone()
        return out

    def _release(self, cancel_loads: bool) -> None:
        """Give the signal handlers back, close the progress line and end the loading thread (online: say what each
        rank scored)."""
        self.stop_request.restore()
        self.progress.close()
        self.prefetch.shutdown(cancel_futures=cancel_loads)
        if self.online is not None:  # every rank: which shards each scored is the point of the scheme
            # one write: ranks share the stderr pipe, and print's separate newline lets their lines interleave
            sys.stderr.write(f"train: {self.online.summary(self.accelerator.process_index)}\n")
