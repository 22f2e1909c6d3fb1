"""The ``dflash`` head's objective: blocks at anchor positions of each document, each drafted in one forward.

An anchor is a position a of a document whose next token t_{a+1} is counted (``loss_mask``). The block at a is
``[t_a, mask, ..., mask]`` at positions ``a..a+B-1``; it attends to the context rows of its own document at positions
``< a`` and to its own B positions (``BlockAttention``), as the runtime's block does after the target has verified
t_0..t_{a-1}. Block position j = 1..B-1 predicts t_{a+j}; it counts where t_{a+j} lies in the document and has
``loss_mask``. The teacher is the target's distribution of t_{a+j} (stored top-K and tail at row a+j-1, or
``exact``); the loss is KL(target || draft) through the frozen lm_head, position j weighted ``decay**(j-1)``
(``train.unroll_decay``): a draft is accepted only up to its first miss, so the first positions matter most. With
``train.dpace_alpha`` the weights are D-PACE's instead (``dpace_weights``), per block, and the loss is their sum over
positions averaged over the batch's blocks.

Anchors: every one by default, since the context's keys are made once per layer for all of a document's blocks;
``train.anchors`` samples that many per document, uniformly, without replacement, from torch's global generator (which
the trainer seeds and checkpoints). Validation takes every anchor, so it is deterministic.

Memory: a batch's blocks run through the head a chunk of consecutive anchors at a time (at most ``LossWeights.
block_rows`` block rows, ``block_chunk_rows``), each chunk over the context rows of its own documents, under
activation checkpointing: backward makes one chunk's activations again at a time, so a step keeps one chunk's
layer activations, not every block's (at every anchor of 16,384 tokens with B = 9, 147,456 rows of a 70B layer).

Choices where the paper and the public implementations differ: the loss is the KL against the stored top-K and tail
that every head here trains on, not cross-entropy against the data's tokens; the mask is a trained vector, not a
frozen embedding row; the block is the trained size here and ``1 + k`` at k drafts in the runtime and in vLLM, unless
``train.block_lengths: uniform`` draws each block's length from 2..B (from the same generator as the anchors), so that
the head trains on the blocks it is served with.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from mtp_train.heads.attention import KeyRanges, range_attention
from mtp_train.heads.dflash import DFlashHead
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights, StepMetrics, vocab_terms

# Block rows a chunk runs through the head at most: a 70B layer keeps about 0.9 MB per row in fp32 (7 GiB a chunk).
BLOCK_ROWS = 8192


def planned_anchors(batch_tokens: int, max_length: int, anchors: int | None) -> int:
    """The blocks a batch of ``batch_tokens`` trains, as the memory plan counts them: one per token with
    ``train.anchors`` unset (every position whose next token counts, at most); else ``anchors`` per document, in
    documents of ``data.max_length`` tokens (a batch of shorter documents trains more blocks)."""
    if not anchors:
        return batch_tokens
    return min(batch_tokens, anchors * -(-batch_tokens // min(max_length, batch_tokens)))


def block_chunk_rows(batch_tokens: int, max_length: int, anchors: int | None, block_size: int) -> int:
    """Block rows per checkpointed chunk: ``BLOCK_ROWS``, or the planned blocks' rows when fewer, whole blocks. A
    batch with more blocks than planned runs more chunks of this size, so its peak stays the plan's."""
    rows = min(BLOCK_ROWS, block_size * planned_anchors(batch_tokens, max_length, anchors))
    return max(block_size, rows - rows % block_size)


class BlockAttention:
    """The attention plan of one training forward over blocks, for every layer (``context`` is set per layer).

    ``anchors``: per document, its anchors' positions ``[A_d]`` (ascending). Block rows are packed document by
    document, anchor by anchor, B rows each; a block row attends to its document's context keys at positions below
    its anchor and to its own block's keys (``range_attention``: a range of context rows, the block as its group), or
    with ``lengths [A]`` (``train.block_lengths: uniform``) to the keys of its block's first ``lengths[a]`` rows.
    With a ``window`` (``head.window``), block row j (position ``anchor + j``) sees the context at positions above its
    own minus the window only, as the runtime's non-causal block does. ``context``: the layer's context keys and
    values ``[T, Hkv, D]``.
    """

    def __init__(self, cu_seqlens: list[int], anchors: list[torch.Tensor], block_size: int,
                 lengths: torch.Tensor | None = None, window: int = 0) -> None:
        lo = [s if not window else s + max(0, p + j - window + 1) for s, a in zip(cu_seqlens, anchors)
              for p in a.tolist() for j in range(block_size)]
        hi = [s + int(p) for s, a in zip(cu_seqlens, anchors) for p in a.tolist() for _ in range(block_size)]
        own = None if lengths is None else lengths.repeat_interleave(block_size)  # [A] -> each block row's
        self.ranges = KeyRanges(lo, hi, block_size, own)
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        """Block rows' ``q [R, Hq, D]``, ``k, v [R, Hkv, D]`` -> ``[R, Hq, D]``."""
        assert self.context is not None, "the head sets each layer's context before the layer runs"
        return range_attention(q, *self.context, self.ranges, [(k, v)])


def sampled(rows: torch.Tensor, sample: int) -> torch.Tensor:
    """One document's candidate anchors ``[n]`` ascending -> all of them, or (``sample`` set and fewer) that many
    drawn uniformly without replacement from torch's global generator, ascending."""
    if sample and rows.numel() > sample:
        rows = rows[torch.randperm(rows.numel(), device=rows.device)[:sample]].sort().values
    return rows


def _anchors(batch: Batch, sample: int) -> list[torch.Tensor]:
    """Per document, the positions whose next token counts ``[A_d]`` ascending: all, or ``sample`` drawn."""
    return [sampled(torch.nonzero(batch.loss_mask[s + 1 : e]).view(-1), sample)  # a where t_{a+1} counts
            for s, e in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])]


def _chunks(counts: list[int], per_chunk: int) -> list[tuple[int, int, int, int]]:
    """Consecutive anchors, ``per_chunk`` at most, as ``(a0, a1, first document, last document)``; documents without
    anchors are skipped."""
    owner = [d for d, c in enumerate(counts) for _ in range(c)]
    return [(a0, min(a0 + per_chunk, len(owner)), owner[a0], owner[min(a0 + per_chunk, len(owner)) - 1])
            for a0 in range(0, len(owner), per_chunk)]


def _through_wrapper_once(forward, head: DFlashHead, frozen: FrozenTarget):
    """One chunk's forward, ``(first token ids [a], aux, context positions, block positions, plan) -> [a * B, H]``,
    as checkpointing runs it: through ``forward`` (DDP's or DeepSpeed's wrapper, which prepares its gradient reduction
    there) in the forward pass, through the module itself when backward makes the chunk again (the wrapper's
    preparation must not run inside backward). The same parameters and arithmetic either way."""
    calls = []

    def run(first: torch.Tensor, *args):
        module = head if calls else forward
        calls.append(1)
        return module(frozen.embed(first), *args)

    return run


def dpace_weights(probs: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's weights ``[A, P]`` of blocks' positions 1..P: with ``s_i = (1 - alpha) q_i + alpha`` (``probs [A, P]``,
    the draft's probability of the target's top-1; 1 where ``counted [A, P]`` is not set), position j weighs
    ``sum_{m >= j, counted} prod_{i <= m} s_i``, the derivative of the smoothed expected accepted length with
    respect to ``log q_j`` (zero where not counted)."""
    smooth = torch.where(counted, (1 - alpha) * probs + alpha, torch.ones_like(probs))
    prefix = torch.cumprod(smooth, -1) * counted
    return (prefix.flip(-1).cumsum(-1).flip(-1) * counted).detach()


def block_loss(head: DFlashHead, frozen: FrozenTarget, batch: Batch, weights: LossWeights, forward=None
               ) -> tuple[torch.Tensor, list[StepMetrics]]:
    """Weighted loss over block positions 1..B-1 and their metrics (``forward``: the head as wrapped for DDP)."""
    forward = forward or head
    size, device, n = head.spec.block_size, batch.tokens.device, batch.num_tokens
    cu = batch.cu_seqlens
    picks = _anchors(batch, weights.anchors)
    if not any(p.numel() for p in picks):
        # No position is trained: the first document's last row anchors a block whose every position falls past
        # the document, so the head still runs its forward through ``forward`` (DDP prepares its all-reduce there,
        # which every rank must join) and the loss reaches it as zero.
        picks[0] = torch.tensor([cu[1] - cu[0] - 1], device=device)
    counts = [p.numel() for p in picks]
    counts_t = torch.tensor(counts, device=device)
    starts, ends = (torch.tensor(x, device=device).repeat_interleave(counts_t) for x in (cu[:-1], cu[1:]))
    local = torch.cat(picks)  # [A]
    lengths = torch.tensor([e - s for s, e in zip(cu[:-1], cu[1:])], device=device)
    context_positions = torch.arange(n, device=device) - torch.tensor(cu[:-1], device=device).repeat_interleave(lengths)
    block_positions = local[:, None] + torch.arange(size, device=device)  # [A, B]
    label = starts[:, None] + block_positions  # rows of t_{a+j}
    counted = (label < ends[:, None]) & batch.loss_mask[label.clamp(max=n - 1)]
    lengths = None
    if weights.block_lengths:  # a block of 1 + k, as served at k drafts: positions past it neither seen nor counted
        lengths = torch.randint(2, size + 1, (local.numel(),), device=device)
        counted &= torch.arange(size, device=device) < lengths[:, None]
    totals = counted.sum(0).tolist()  # per block position, over every chunk
    exact = weights.teacher == "exact"
    total = batch.hidden.new_zeros(())
    sums = [[batch.hidden.new_zeros(()), batch.hidden.new_zeros((), dtype=torch.long)] for _ in range(size)]
    for a0, a1, d0, d1 in _chunks(counts, max(1, (weights.block_rows or BLOCK_ROWS) // size)):
        # the chunk's context: its documents' rows from the first one's start to the last one's last anchor
        first = a0 - sum(counts[:d0])
        sub = [picks[d0][first:]] + picks[d0 + 1 : d1] + [picks[d1][: a1 - sum(counts[:d1])]] if d1 > d0 else [
            picks[d0][first : first + a1 - a0]]
        s, e = cu[d0], cu[d1] + int(sub[-1][-1])
        plan = BlockAttention([c - s for c in cu[d0 : d1 + 1]], sub, size, None if lengths is None else lengths[a0:a1],
                              head.spec.window)
        run = _through_wrapper_once(forward, head, frozen)
        args = (batch.tokens[(starts + local)[a0:a1]], batch.aux[s:e], context_positions[s:e],
                block_positions[a0:a1].reshape(-1), plan)
        out = (checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False) if torch.is_grad_enabled()
               else run(*args)).view(a1 - a0, size, -1)
        kls, probs = out.new_zeros(a1 - a0, size), out.new_ones(a1 - a0, size)  # (D-PACE: per block and position)
        for j in range(1, size):
            keep = counted[a0:a1, j]
            rows = label[a0:a1][keep, j] - 1  # the target's distribution of t_{a+j} is stored at row a+j-1
            if totals[j] == 0 or rows.numel() == 0:
                continue
            teacher = [batch.hidden[rows]] if exact else [batch.topk_logprobs[rows], batch.topk_ids[rows],
                                                          batch.tail_logprob[rows]]
            kl, draft_top1, target_top1, q_top1 = vocab_terms(frozen, head.lm_head_input(out[keep, j]), teacher,
                                                              exact, weights.lk)
            if weights.dpace is None:
                total = total + weights.decay ** (j - 1) * weights.w_logits * kl.sum() / totals[j]
            else:
                kls[keep, j], probs[keep, j] = kl, q_top1
            sums[j][0] = sums[j][0] + kl.detach().sum()
            sums[j][1] = sums[j][1] + (draft_top1 == target_top1).sum()
        if weights.dpace is not None:
            weight = dpace_weights(probs[:, 1:], counted[a0:a1, 1:], weights.dpace)
            total = total + weights.w_logits * (weight * kls[:, 1:]).sum() / max(1, local.numel())
    metrics = [StepMetrics(weights.w_logits * sums[j][0] / max(1, totals[j]), int(sums[j][1]), totals[j])
               for j in range(1, size)]
    return total, metrics
