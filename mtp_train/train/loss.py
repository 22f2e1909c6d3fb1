"""The head's training objective over packed documents, with unrolled steps.

Step j (0-based) at document position i reads the token t_{i+1+j} and a hidden input: the
target's h_i for j = 0 (on the side of the final norm the head reads), else the head's own step
j-1 state at position i as chained drafting feeds it back (``DraftHead.feedback_state``: its output,
or its output after its final norm). It predicts t_{i+2+j}, so that fed-back state is matched to the
target's hidden h_{i+1+j} (SmoothL1, on the side the head reads) and to the target's distribution of
t_{i+2+j} (KL(target || draft)). Only positions whose label token has ``loss_mask == 1`` count (with
``train.mask_gate: input``, those whose token two before the label has it: SpecForge's alignment);
labels never cross a document boundary. Step j's loss is weighted by ``decay**j``.

Top-K teacher: the target's top-K probabilities plus one bucket for the rest of the mass, read
from the stored fp32 ``tail_logprob`` (computed from the full logits, not from the bf16 top-K);
the bf16 top-K probabilities are rescaled to hold exactly the rest. The draft is coarse-grained
the same way (its mass on those K tokens, and the rest, both in fp32 log space). The KL between
these K+1-bucket distributions is exact when K covers the mass, and a lower bound of the full
KL otherwise (``bench/topk_kl.py`` measures how far). ``exact`` recomputes ``lm_head(final_norm(h))`` instead.

The vocabulary terms (the KL and the draft's top-1) are computed a chunk of rows at a time, each chunk's
``[rows, vocab]`` fp32 tensors freed after its forward and rebuilt one chunk at a time in backward, so that the
loss's own memory is bounded by ``CHUNK_BYTES`` whatever the batch (``bench/loss_memory.py`` measures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch


# Bytes of one [rows, vocab] fp32 tensor of a chunk: 523 rows at vocab 128,256. Forward and backward hold a few
# such tensors at a time, so the loss's peak is about 1 GiB on top of its inputs and gradients.
CHUNK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class LossWeights:
    w_hidden: float
    w_logits: float
    unroll: int
    decay: float
    teacher: str  # "topk" or "exact"
    gate_offset: int = 0  # the prediction of token i counts where loss_mask[i - gate_offset] is set
    anchors: int = 0  # dflash: blocks sampled per document (0: a block at every anchor)
    block_rows: int = 0  # dflash: block rows per checkpointed chunk (0: blocks.BLOCK_ROWS)
    block_lengths: bool = False  # dflash: each block trains at a length drawn from 2..block_size (else them all)
    lk: bool = False  # the LK loss in place of the KL (``lk_mix``)
    dpace: float | None = None  # dflash: D-PACE's smoothing alpha, its position weights in place of ``decay**j``


@dataclass
class StepMetrics:
    loss: torch.Tensor  # scalar, this step's unweighted loss
    correct: int  # draft top-1 == target top-1, over counted positions
    count: int


def lk_mix(kl: torch.Tensor, p: torch.Tensor, q: torch.Tensor, lk: bool) -> torch.Tensor:
    """The per-row loss ``[n]`` from the KL ``kl [n]`` and the two distributions over the same buckets ``p, q [n, B]``:
    the KL itself, or with ``lk`` the LK loss (LK losses, arXiv 2602.23881; speculators' ``lk_hybrid``)
    ``lam * KL + (1 - lam) * (1 - alpha)``, where ``alpha = sum min(p, q)`` is the probability that a draft
    sampled from q is accepted and ``lam = exp(-3 alpha)`` (no gradient through lam): the KL while the overlap is
    small, the acceptance itself as it grows."""
    if not lk:
        return kl
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-3 * alpha).detach()
    return lam * kl + (1 - lam) * (1 - alpha)


def kl_topk(draft_logp: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor, tail_lp: torch.Tensor,
            lk: bool = False) -> torch.Tensor:
    """Per-row KL over K+1 buckets: ``draft_logp [n, V]``, stored ``lp, ids [n, K]`` and ``tail_lp [n]`` -> ``[n]``
    (``lk``: the LK loss over the same buckets, ``lk_mix``).

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
    buckets = lambda head, rest: torch.cat([head, rest[:, None]], -1).exp()  # noqa: E731
    return lk_mix(kl + tail, buckets(lp, tail_lp), buckets(q_logk, rest_q_log), lk)


def chunk_rows(vocab: int) -> int:
    """Rows per chunk of the vocabulary terms: ``rows * vocab * 4 <= CHUNK_BYTES``, at least 1."""
    return max(1, CHUNK_BYTES // (vocab * 4))


def _vocab_chunk(frozen: FrozenTarget, exact: bool, lk: bool, x: torch.Tensor, *teacher: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: lm_head inputs ``x [c, H]`` and the teacher's rows (exact: pre-norm target hidden ``[c, H]``;
    top-K: ``lp, ids [c, K]``, ``tail_lp [c]``) -> KL ``[c]`` fp32 (``lk``: the LK loss), draft top-1 and target
    top-1 ``[c]`` int64, and the draft's probability of the target's top-1 ``[c]`` fp32 (no gradient)."""
    draft_logp = torch.log_softmax(frozen.logits(x), dim=-1)
    if exact:
        target_logp = torch.log_softmax(frozen.logits(frozen.final_norm(teacher[0])), dim=-1)
        kl = lk_mix((target_logp.exp() * (target_logp - draft_logp)).sum(-1), target_logp.exp(), draft_logp.exp(), lk)
        target_top1 = target_logp.argmax(-1)
    else:
        kl, target_top1 = kl_topk(draft_logp, *teacher, lk=lk), teacher[1][:, 0]
    q_top1 = draft_logp.detach().gather(-1, target_top1[:, None])[:, 0].exp()
    return kl, draft_logp.argmax(-1), target_top1, q_top1


def vocab_terms(frozen: FrozenTarget, x: torch.Tensor, teacher: list[torch.Tensor], exact: bool, lk: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_vocab_chunk`` over all rows, ``chunk_rows(vocab)`` at a time: ``x [n, H]`` and the teacher's ``[n, ...]``
    -> KL ``[n]`` fp32 (``lk``: the LK loss; differentiable w.r.t. ``x``), draft top-1 and target top-1 ``[n]``
    int64, the draft's probability of the target's top-1 ``[n]`` (no gradient).

    Non-reentrant checkpointing keeps only each chunk's inputs and recomputes its forward in backward, where the
    autograd engine runs one chunk's nodes at a time (later chunks first) and frees them as it goes. It is chosen
    over a hand-written autograd.Function because the formula then exists once, its backward is autograd's own
    (so the gradients are those of the unchunked loss), and any input that requires grad is handled. No RNG is
    drawn, so its state is not saved.
    """
    rows = chunk_rows(frozen.lm_head_weight.shape[0])
    chunks = zip(x.split(rows), *(t.split(rows) for t in teacher))
    parts = [checkpoint(_vocab_chunk, frozen, exact, lk, *c, use_reentrant=False, preserve_rng_state=False)
             for c in chunks]
    kl, draft_top1, target_top1, q_top1 = (torch.cat(p) for p in zip(*parts))
    return kl, draft_top1, target_top1, q_top1


def _ragged_arange(starts: list[int], counts: list[int], device: torch.device | None) -> torch.Tensor:
    """``cat([arange(s, s + c) for s, c in zip(starts, counts)])`` as one ``[sum(counts)]`` int64 on ``device``,
    in a few ops rather than one per document."""
    total = sum(counts)
    shift = [s - b for s, b in zip(starts, accumulate(counts, initial=0))]  # start minus where its run begins
    runs = torch.tensor(shift, dtype=torch.long, device=device).repeat_interleave(
        torch.tensor(counts, dtype=torch.long, device=device), output_size=total)
    return torch.arange(total, device=device) + runs


def _step_index(cu: list[int], step: int, device: torch.device | None = None) -> tuple[torch.Tensor, list[int]]:
    """Rows ``i`` (document start + offset) that have a label at ``step``, ``[rows]`` int64 on ``device``, and the
    step's document offsets."""
    counts = [max(0, stop - start - 2 - step) for start, stop in zip(cu[:-1], cu[1:])]
    return _ragged_arange(cu[:-1], counts, device), list(accumulate(counts, initial=0))


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
    device = batch.tokens.device
    for j in range(weights.unroll):
        rows, step_cu = _step_index(batch.cu_seqlens, j, device)
        if j and rows.numel() == 0:  # (step 0 runs even then: DDP prepares its all-reduce in the forward)
            break
        counts = [b - a for a, b in zip(step_cu[:-1], step_cu[1:])]
        if j == 0:
            hidden_in = hidden_side[rows]
        else:  # own previous output at the same document positions
            hidden_in = prev_out[_ragged_arange(prev_cu[:-1], counts, device)]
        positions = _ragged_arange([j] * len(counts), counts, device)
        out = forward(frozen.embed(batch.tokens[rows + 1 + j]), hidden_in, positions, step_cu)
        fed_back = head.feedback_state(out)  # what the next step reads, as chained drafting feeds it
        mask = batch.loss_mask[rows + 2 + j - weights.gate_offset]
        count = int(mask.sum())
        prev_out, prev_cu = fed_back, step_cu
        if count == 0:
            metrics.append(StepMetrics(out.new_zeros(()), 0, 0))
            continue
        target_rows = rows[mask] + 1 + j
        sl1 = F.smooth_l1_loss(fed_back[mask], hidden_side[target_rows], reduction="none").mean(-1)
        exact = weights.teacher == "exact"
        teacher = [batch.hidden[target_rows]] if exact else [
            batch.topk_logprobs[target_rows], batch.topk_ids[target_rows], batch.tail_logprob[target_rows]]
        kl, draft_top1, target_top1, _ = vocab_terms(frozen, head.lm_head_input(out[mask]), teacher, exact, weights.lk)
        step_loss = weights.w_hidden * sl1.mean() + weights.w_logits * kl.mean()
        total = total + (weights.decay**j) * step_loss
        correct = int((draft_top1 == target_top1).sum())
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
