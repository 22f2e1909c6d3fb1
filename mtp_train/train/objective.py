"""The head's objective as the trainer optimizes and validates it: the loss weights a recipe sets, the held-out
batches, the loss (training-time test for an eagle3 head, blocks for a dflash head, else the unrolled ``head_loss``)
and the teacher-forced validation. The eval runs the same ``validate`` with the runtime's paged forward;
``mtp_train.train.trainer`` names all four too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from mtp_train.heads import DraftHead
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.recipe import Recipe
from mtp_train.train.blocks import block_chunk_rows, block_loss
from mtp_train.train.data import Batch, load_batch
from mtp_train.train.loss import LossWeights, StepMetrics, head_loss, simulated_tau
from mtp_train.train.parallel import parallel_loss
from mtp_train.train.ttt import ttt_loss
from mtp_train.features.online import Features


def loss_weights(recipe: Recipe) -> LossWeights:
    """The recipe's loss settings, ``unroll`` counting the steps the loss reports."""
    t, head = recipe.train, recipe.head
    # (train.mask_gate input with a dflash head is refused where the recipe is read, before any stage runs)
    # a dflash head's steps are its block positions 1..B-1; a P-EAGLE head's its first step and mask positions
    steps = {"dflash": head.block_size - 1, "eagle3": head.parallel_drafts or t.unroll}.get(head.kind, t.unroll)
    return LossWeights(t.w_hidden, t.w_logits, steps, t.unroll_decay, t.teacher, 2 if t.mask_gate == "input" else 0,
                       t.anchors or 0, block_chunk_rows(t.batch_tokens, recipe.data.max_length, t.anchors,
                                                        head.block_size), t.block_lengths == "uniform", t.loss == "lk",
                       t.dpace_alpha if head.kind == "dflash" else None)


def heldout_batches(reader: Features, batch_tokens: int, aux: tuple[int, ...] = ()) -> Iterator[Batch]:
    """The held-out sequences, 16 per batch, in stored order (with the stored layers ``aux`` as ``Batch.aux``)."""
    refs = reader.heldout
    for i in range(0, len(refs), 16):
        yield load_batch(reader, refs[i : i + 16], batch_tokens, torch.float32, aux=aux)


def objective(head: DraftHead, frozen: FrozenTarget, batch: Batch, weights: LossWeights,
              forward: Callable[..., torch.Tensor] | None = None) -> tuple[torch.Tensor, list[StepMetrics]]:
    """The head's training loss (a scalar tensor) and per-step metrics: training-time test for ``eagle3``, blocks for
    ``dflash``, else ``head_loss``. ``forward`` replaces the head's own forward (the DDP wrapper, the runtime's paged
    forward)."""
    loss = {"eagle3": parallel_loss if head.spec.parallel_drafts else ttt_loss, "dflash": block_loss}.get(
        head.spec.kind, head_loss)
    value, metrics = loss(head, frozen, batch, weights, forward)
    if torch.is_grad_enabled() and not value.requires_grad:
        # No position of the batch is trained (a conversation cut off before its answer, alone in its batch): a zero
        # that reaches every trainable weight, so that backward (and DDP's all-reduce) runs with zero gradients.
        value = sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0
    return value, metrics


@torch.no_grad()
def validate(head: DraftHead, frozen: FrozenTarget, batches: Iterable[Batch], weights: LossWeights,
             forward: Callable[..., torch.Tensor] | None = None) -> dict[str, Any]:
    """Teacher-forced loss and top-1 accuracy per unrolled step over ``batches``.

    ``forward`` replaces the head's own forward (the eval passes the runtime's paged implementation). Every
    predicted assistant token counts, whichever ``train.mask_gate`` trained the head.
    """
    # the predicted assistant tokens, whatever trains; every block, in chunks of the default size (no activations are
    # kept without gradients, so the chunk a train.anchors plan sets for training would only slow this down)
    weights = replace(weights, gate_offset=0, anchors=0, block_rows=0, block_lengths=False, lk=False)  # the KL
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
