"""P-EAGLE's objective: an eagle3 head drafting K tokens in one forward (``head.parallel_drafts``), as vLLM's
parallel drafting runs it.

Step 0 is the training-time test's first step (``ttt_loss`` at ``unroll`` 1): row i reads t_{i+1} and ``fc`` of the
target's states at i and predicts t_{i+2}; its keys are the context the mask positions attend to. At an anchor row
a, mask position j = 1..K-1 sits at RoPE position a + j, reads the frozen embedding of ``mask_token_id`` and
``mask_hidden`` in place of the target's states (``fc`` applied as to them), attends to the step-0 keys of its
document's rows <= a and to the keys of its own anchor's mask positions 1..j (causal), and predicts t_{a+2+j}: what
the runtime's forward computes after the target has verified up to t_{a+1}. It counts where t_{a+2+j} lies in the
document and is gated as chain step j would be (``loss_mask``, ``gate_offset``); its teacher, the target's
distribution restricted to the draft vocabulary, is stored at row a+1+j. Mask position j's loss is weighted
``decay**j``. Anchors: every row with a counted mask position, or ``train.anchors`` of them per document, drawn
from torch's global generator as dflash's are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mtp_train.heads.attention import KeyRanges, range_attention
from mtp_train.heads.eagle3 import Eagle3Head
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights, StepMetrics
from mtp_train.train.blocks import sampled
from mtp_train.train.ttt import TTTAttention, document_rows, draft_step_loss, ttt_loss, vocab_index


class MaskAttention:
    """Mask rows' attention: row r sees context keys ``lo[r] <= m < hi[r]`` (step 0's, of its document up to its
    anchor) and the keys of its group's (anchor's) mask rows up to itself."""

    def __init__(self, context: tuple[torch.Tensor, torch.Tensor], lo: list[int], hi: list[int], masks: int,
                 device: torch.device) -> None:
        own = torch.arange(1, masks + 1, device=device).repeat(len(lo) // masks)  # row j - 1 of a group sees j rows
        self.ranges = KeyRanges(lo, hi, masks, own)
        self.context = context

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        """Mask rows' ``q [R, Hq, D]``, ``k, v [R, Hkv, D]`` -> ``[R, Hq, D]``."""
        return range_attention(q, *self.context, self.ranges, [(k, v)])


def _anchors(counted: torch.Tensor, cu: list[int], sample: int) -> torch.Tensor:
    """Rows with a counted mask position ``counted [T, K-1]`` -> the anchor rows ``[A]`` ascending: all, or
    ``sample`` per document drawn."""
    picks = [sampled(torch.nonzero(counted[s:e].any(1)).view(-1) + s, sample) for s, e in zip(cu[:-1], cu[1:])]
    return torch.cat(picks) if picks else counted.new_zeros(0, dtype=torch.long)


def parallel_loss(head: Eagle3Head, frozen: FrozenTarget, batch: Batch, weights: LossWeights, forward=None
                  ) -> tuple[torch.Tensor, list[StepMetrics]]:
    """Weighted loss over step 0 and the mask positions, and their metrics (K of them; ``forward``: the head as
    wrapped for DDP)."""
    forward = forward or head
    drafts, device, n, cu = head.spec.parallel_drafts, batch.tokens.device, batch.num_tokens, batch.cu_seqlens
    plan = TTTAttention(cu)
    total, metrics = ttt_loss(head, frozen, batch, replace(weights, unroll=1), forward, plan)
    rows, starts, ends = document_rows(cu, device)
    j = torch.arange(1, drafts, device=device)
    label = rows[:, None] + 2 + j  # [T, K-1]: the row of t_{a+2+j}
    counted = (label < ends[:, None]) & batch.loss_mask[(label - weights.gate_offset).clamp(min=0, max=n - 1)]
    anchors = _anchors(counted, cu, weights.anchors)
    masks = drafts - 1
    if anchors.numel() == 0:
        return total, metrics + [StepMetrics(total.new_zeros(()), 0, 0)] * masks
    embeds = frozen.embed(torch.full((anchors.numel() * masks,), head.spec.mask_token_id, device=device))
    positions = ((anchors - starts[anchors])[:, None] + j).view(-1)
    aux = head.mask_hidden.to(batch.aux.dtype)[None].expand(embeds.shape[0], -1)
    lo = starts[anchors].repeat_interleave(masks).tolist()
    hi = (anchors + 1).repeat_interleave(masks).tolist()
    mask_plan = MaskAttention((plan.keys[0], plan.values[0]), lo, hi, masks, device)
    out = forward(embeds, None, positions, mask_plan, aux).view(anchors.numel(), masks, -1)
    t2d = vocab_index(head, frozen.cfg.vocab_size)
    for m in range(masks):
        keep = counted[anchors, m]
        if not bool(keep.any()):
            metrics.append(StepMetrics(out.new_zeros(()), 0, 0))
            continue
        step_loss, metric = draft_step_loss(head, frozen, batch, weights, t2d, out[keep, m],
                                            label[anchors[keep], m] - 1)
        total = total + weights.decay ** (m + 1) * step_loss
        metrics.append(metric)
    return total, metrics
