"""The head's training objective over packed documents, with unrolled steps.

Step j (0-based) at document position i reads the token t_{i+1+j} and a hidden input: the
target's h_i for j = 0, else the head's own step j-1 output at position i (as chained drafting
does at inference). It predicts t_{i+2+j}, so it is matched to the target's hidden h_{i+1+j}
(SmoothL1, on the side of the final norm the head works on) and to the target's distribution of
t_{i+2+j} (KL(target || draft)). Only positions whose label token has ``loss_mask == 1`` count;
labels never cross a document boundary. Step j's loss is weighted by ``decay**j``.

Top-K teacher: the target's top-K probabilities plus one bucket for the rest of the mass, read
from the stored fp32 ``tail_logprob`` (computed from the full logits, not from the bf16 top-K);
the bf16 top-K probabilities are rescaled to hold exactly the rest. The draft is coarse-grained
the same way (its mass on those K tokens, and the rest, both in fp32 log space). The KL between
these K+1-bucket distributions is exact when K covers the mass, and a lower bound of the full
KL otherwise (``bench/topk_kl.py`` measures how far). ``exact`` recomputes ``lm_head(final_norm(h))`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch


@dataclass(frozen=True)
class LossWeights:
    w_hidden: float
    w_logits: float
    unroll: int
    decay: float
    teacher: str  # "topk" or "exact"


@dataclass
class StepMetrics:
    loss: torch.Tensor  # scalar, this step's unweighted loss
    correct: int  # draft top-1 == target top-1, over counted positions
    count: int


def kl_topk(draft_logp: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor, tail_lp: torch.Tensor) -> torch.Tensor:
    """Per-row KL over K+1 buckets: ``draft_logp [n, V]``, stored ``lp, ids [n, K]`` and ``tail_lp [n]`` -> ``[n]``.

    The top-K log-probs are shifted so that their mass is exactly ``1 - exp(tail_lp)``.
    """
    tail_lp = tail_lp.float()
    head_mass = -torch.expm1(tail_lp).clamp(max=-1e-12)  # 1 - tail, > 0
    lp = lp.float()
    lp = lp - torch.logsumexp(lp, -1, keepdim=True) + head_mass.log()[:, None]
    q_logk = draft_logp.gather(-1, ids)
    rest_q_log = torch.log(-torch.expm1(torch.logsumexp(q_logk, -1).clamp(max=-1e-7)))
    kl = (lp.exp() * (lp - q_logk)).sum(-1)
    tail = torch.where(tail_lp > -torch.inf, tail_lp.exp() * (tail_lp - rest_q_log), torch.zeros_like(tail_lp))
    return kl + tail


def _step_index(cu: list[int], step: int) -> tuple[torch.Tensor, list[int]]:
    """Rows ``i`` (document start + offset) that have a label at ``step``, and the step's document offsets."""
    rows, step_cu = [], [0]
    for start, stop in zip(cu[:-1], cu[1:]):
        n = max(0, stop - start - 2 - step)
        rows.append(torch.arange(start, start + n))
        step_cu.append(step_cu[-1] + n)
    return torch.cat(rows), step_cu


def head_loss(
    head: DraftHead, frozen: FrozenTarget, batch: Batch, weights: LossWeights, forward=None
) -> tuple[torch.Tensor, list[StepMetrics]]:
    """Weighted loss over all unrolled steps, and per-step metrics.

    ``forward`` is the head as wrapped for distributed training (DDP), when it is.
    """
    forward = forward or head
    post_norm = head.spec.hidden_input == "post_norm"
    hidden_side = frozen.final_norm(batch.hidden) if post_norm else batch.hidden
    total = batch.hidden.new_zeros(())
    metrics: list[StepMetrics] = []
    prev_out, prev_cu = None, None
    for j in range(weights.unroll):
        rows, step_cu = _step_index(batch.cu_seqlens, j)
        if rows.numel() == 0:
            break
        if j == 0:
            hidden_in = hidden_side[rows]
        else:  # own previous output at the same document positions
            keep = torch.cat([torch.arange(a, a + (b2 - a2)) for a, a2, b2 in zip(prev_cu[:-1], step_cu[:-1], step_cu[1:])])
            hidden_in = prev_out[keep]
        starts = torch.tensor(batch.cu_seqlens[:-1]).repeat_interleave(torch.tensor(step_cu[1:]) - torch.tensor(step_cu[:-1]))
        positions = rows - starts + j
        out = forward(frozen.embed(batch.tokens[rows + 1 + j]), hidden_in, positions, step_cu)
        mask = batch.loss_mask[rows + 2 + j]
        count = int(mask.sum())
        prev_out, prev_cu = out, step_cu
        if count == 0:
            metrics.append(StepMetrics(out.new_zeros(()), 0, 0))
            continue
        target_rows = rows[mask] + 1 + j
        sl1 = F.smooth_l1_loss(out[mask], hidden_side[target_rows], reduction="none").mean(-1)
        draft_logp = torch.log_softmax(frozen.logits(head.lm_head_input(out[mask])), dim=-1)
        if weights.teacher == "exact":
            target_logp = torch.log_softmax(frozen.logits(frozen.final_norm(batch.hidden[target_rows])), dim=-1)
            kl = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
            target_top1 = target_logp.argmax(-1)
        else:
            kl = kl_topk(draft_logp, batch.topk_logprobs[target_rows], batch.topk_ids[target_rows],
                         batch.tail_logprob[target_rows])
            target_top1 = batch.topk_ids[target_rows, 0]
        step_loss = weights.w_hidden * sl1.mean() + weights.w_logits * kl.mean()
        total = total + (weights.decay**j) * step_loss
        correct = int((draft_logp.argmax(-1) == target_top1).sum())
        metrics.append(StepMetrics(step_loss.detach(), correct, count))
    return total, metrics


def simulated_tau(accuracies: list[float]) -> float:
    """Acceptance length (bonus token included) if step j's draft is accepted with probability ``accuracies[j]``
    given the earlier ones were: ``1 + a0 + a0*a1 + ...``."""
    tau, run = 1.0, 1.0
    for a in accuracies:
        run *= a
        tau += run
    return tau
