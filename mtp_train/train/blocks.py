"""The ``dflash`` head's objective: blocks at anchor positions of each document, each drafted in one forward.

An anchor is a position a of a document whose next token t_{a+1} is counted (``loss_mask``). The block at a is
``[t_a, mask, ..., mask]`` at positions ``a..a+B-1``; it attends to the context rows of its own document at positions
``< a`` and to its own B positions (``BlockAttention``), as the runtime's block does after the target has verified
t_0..t_{a-1}. Block position j = 1..B-1 predicts t_{a+j}; it counts where t_{a+j} lies in the document and has
``loss_mask``. The teacher is the target's distribution of t_{a+j} (stored top-K and tail at row a+j-1, or
``exact``); the loss is KL(target || draft) through the frozen lm_head, position j weighted ``decay**(j-1)``
(``train.unroll_decay``): a draft is accepted only up to its first miss, so the first positions matter most.

Anchors: every one by default, since the context's keys are made once per layer for all of a document's blocks;
``train.anchors`` samples that many per document, uniformly, without replacement, from torch's global generator (which
the trainer seeds and checkpoints). Validation takes every anchor, so it is deterministic.

Choices where the paper and the public implementations differ: the loss is the KL against the stored top-K and tail
that every head here trains on, not cross-entropy against the data's tokens; the mask is a trained vector, not a
frozen embedding row; the block is the trained size here and ``1 + k`` at k drafts in the runtime and in vLLM.
"""

from __future__ import annotations

import torch

from mtp_train.heads.dflash import DFlashHead
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights, StepMetrics, vocab_terms


class BlockAttention:
    """The attention plan of one training forward over blocks, for every layer (``context`` is set per layer).

    ``anchors``: per document, its anchors' positions ``[A_d]`` (ascending). Block rows are packed document by
    document, anchor by anchor, B rows each; a block row attends to its document's context keys at positions below
    its anchor and to its own block's keys. ``context``: the layer's context keys and values ``[T, Hkv, D]``.
    """

    def __init__(self, cu_seqlens: list[int], anchors: list[torch.Tensor], block_size: int) -> None:
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        self.anchors = anchors
        self.block_size = block_size
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        """Block rows' ``q [R, Hq, D]``, ``k, v [R, Hkv, D]`` -> ``[R, Hq, D]``."""
        assert self.context is not None, "the head sets each layer's context before the layer runs"
        ctx_k, ctx_v = self.context
        parts, row = [], 0
        for (s, e), anchors in zip(self.bounds, self.anchors):
            r = anchors.numel() * self.block_size
            if r:
                rows = slice(row, row + r)
                parts.append(_attend_blocks(q[rows], k[rows], v[rows], ctx_k[s:e], ctx_v[s:e], anchors,
                                            self.block_size))
            row += r
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                   anchors: torch.Tensor, size: int) -> torch.Tensor:
    """One document: block rows ``q [A*B, Hq, D]``, ``k, v [A*B, Hkv, D]``, context ``ctx_k, ctx_v [n, Hkv, D]``,
    anchors ``[A]`` -> ``[A*B, Hq, D]``.

    Scores against the context ``[Hq, A*B, n]`` (a prefix per anchor) and against the own block ``[Hq, A*B, B]`` are
    taken apart and softmaxed together: a dense mask over every block's keys would be A times larger.
    """
    a, (r, hq, d) = anchors.numel(), q.shape
    rep = hq // k.shape[1]
    k, v, ctx_k, ctx_v = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (k, v, ctx_k, ctx_v))
    scale = d**-0.5
    s_ctx = torch.einsum("rhd,nhd->hrn", q, ctx_k) * scale
    seen = torch.arange(ctx_k.shape[0], device=q.device)[None, :] < anchors.repeat_interleave(size)[:, None]
    s_ctx = s_ctx.masked_fill(~seen, float("-inf"))
    qb, kb = q.view(a, size, hq, d), k.view(a, size, hq, d)
    s_blk = torch.einsum("aihd,ajhd->haij", qb, kb).reshape(hq, r, size) * scale
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    p_ctx, p_blk = p.split([ctx_k.shape[0], size], dim=-1)
    out = torch.einsum("hrn,nhd->rhd", p_ctx, ctx_v)
    own = torch.einsum("haij,ajhd->aihd", p_blk.reshape(hq, a, size, size), v.view(a, size, hq, d))
    return out + own.reshape(r, hq, d)


def _anchors(batch: Batch, sample: int) -> list[torch.Tensor]:
    """Per document, the positions whose next token counts ``[A_d]`` ascending: all, or ``sample`` drawn."""
    picks = []
    for s, e in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
        local = torch.nonzero(batch.loss_mask[s + 1 : e]).view(-1)  # a where t_{a+1} counts
        if sample and local.numel() > sample:
            local = local[torch.randperm(local.numel(), device=local.device)[:sample]].sort().values
        picks.append(local)
    return picks


def block_loss(head: DFlashHead, frozen: FrozenTarget, batch: Batch, weights: LossWeights, forward=None
               ) -> tuple[torch.Tensor, list[StepMetrics]]:
    """Weighted loss over block positions 1..B-1 and their metrics (``forward``: the head as wrapped for DDP)."""
    forward = forward or head
    size, device, n = head.spec.block_size, batch.tokens.device, batch.num_tokens
    cu = batch.cu_seqlens
    picks = _anchors(batch, weights.anchors)
    counts = torch.tensor([p.numel() for p in picks], device=device)
    starts, ends = (torch.tensor(x, device=device).repeat_interleave(counts) for x in (cu[:-1], cu[1:]))
    local = torch.cat(picks)  # [A]
    a = local.numel()
    metrics: list[StepMetrics] = []
    if a == 0:
        return batch.hidden.new_zeros(()), [StepMetrics(batch.hidden.new_zeros(()), 0, 0)] * (size - 1)
    lengths = torch.tensor([e - s for s, e in zip(cu[:-1], cu[1:])], device=device)
    context_positions = torch.arange(n, device=device) - torch.tensor(cu[:-1], device=device).repeat_interleave(lengths)
    block_positions = local[:, None] + torch.arange(size, device=device)  # [A, B]
    label = starts[:, None] + block_positions  # rows of t_{a+j}
    counted = (label < ends[:, None]) & batch.loss_mask[label.clamp(max=n - 1)]
    plan = BlockAttention(cu, picks, size)
    out = forward(frozen.embed(batch.tokens[starts + local]), batch.aux, context_positions, block_positions.view(-1),
                  plan).view(a, size, -1)
    exact = weights.teacher == "exact"
    total = batch.hidden.new_zeros(())
    for j in range(1, size):
        keep = counted[:, j]
        count = int(keep.sum())
        if count == 0:
            metrics.append(StepMetrics(out.new_zeros(()), 0, 0))
            continue
        rows = label[keep, j] - 1  # the target's distribution of t_{a+j} is stored at row a+j-1
        teacher = [batch.hidden[rows]] if exact else [batch.topk_logprobs[rows], batch.topk_ids[rows],
                                                      batch.tail_logprob[rows]]
        kl, draft_top1, target_top1 = vocab_terms(frozen, head.lm_head_input(out[keep, j]), teacher, exact)
        step_loss = weights.w_logits * kl.mean()
        total = total + weights.decay ** (j - 1) * step_loss
        metrics.append(StepMetrics(step_loss.detach(), int((draft_top1 == target_top1).sum()), count))
    return total, metrics
