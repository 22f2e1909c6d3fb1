"""Training-time test: the ``eagle3`` head's objective over packed documents, ``train.unroll`` steps.

Every step runs over all positions of the batch. Step j at document position i reads the token t_{i+1+j} and a
hidden input: ``fc`` of the target's aux states at i for j = 0, else the head's own step j-1 output at i as chained
drafting feeds it back (``feedback_state``: after the final norm for a ``norm_output`` head). It predicts t_{i+2+j}
at RoPE position i + j. Its attention (``TTTAttention``) sees what the runtime's draft would hold there: the step-0
keys at positions <= i of its document (made from the target's states) and, from steps 1..j, only the keys at its
own row (the draft's own earlier chain steps).

The teacher is the target's distribution of t_{i+2+j} restricted to the draft vocabulary S and renormalised: the
draft can place mass on S only, and q = p|S is the best it can do (its acceptance, the sum of min(p, q), is then
p(S), the most any q on S reaches). Positions whose target top-1 lies outside S are left out of the loss, as
SpecForge does, since no draft over S is ever accepted there greedily; they still count, as misses, in the top-1
accuracy, so the simulated τ is the head's real one. With the stored top-K, the mass outside the top-K (the tail)
is taken to lie in S. There is no hidden-state term: the fed-back state has no target counterpart. Step j's loss
is weighted by ``decay**j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mtp_train.heads.attention import causal_ranges, range_attention
from mtp_train.heads.eagle3 import Eagle3Head
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights, StepMetrics, chunk_rows, lk_mix


class TTTAttention:
    """The attention plan of one training-time-test forward, for one decoder layer, kept across its steps.

    Step 0 stores its keys and values; step j > 0 appends its own. A query at row i of a document attends to the
    step-0 keys at rows ``<= i`` of that document and to the keys of steps ``1..j`` at row ``i``: a range of context
    rows and j keys of its own, which ``range_attention`` takes a chunk of rows at a time, so that no score matrix
    (nor a dense ``[T, steps * T]`` mask) is kept for backward. With a ``window`` (``head.window``), step j's query
    stands at position i + j and sees the step-0 keys above i + j - window only (its own keys all lie within it).
    """

    def __init__(self, cu_seqlens: list[int], window: int = 0) -> None:
        self.cu_seqlens, self.window = cu_seqlens, window
        self.ranges = causal_ranges(cu_seqlens)
        self.keys: list[torch.Tensor] = []  # per step [T, Hkv, D]
        self.values: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` of the current step -> ``[T, Hq, D]``."""
        self.keys.append(k)
        self.values.append(v)
        ranges = causal_ranges(self.cu_seqlens, self.window, len(self.keys) - 1) if self.window else self.ranges
        return range_attention(q, self.keys[0], self.values[0], ranges, list(zip(self.keys[1:], self.values[1:])))


def restricted_kl(draft_logp: torch.Tensor, lp: torch.Tensor, draft_index: torch.Tensor,
                  tail_lp: torch.Tensor, lk: bool = False) -> torch.Tensor:
    """Per-row KL(p|S || q) over buckets: ``draft_logp [n, N]`` over S; the stored top-K ``lp [n, K]`` with their
    draft indices ``draft_index [n, K]`` (-1 outside S) and ``tail_lp [n]``, the tail taken to lie in S -> ``[n]``
    (``lk``: the LK loss over the same buckets, ``lk_mix``)."""
    tail_lp = tail_lp.float()
    head_mass = -torch.expm1(tail_lp).clamp(max=-1e-12)
    lp = lp.float()
    lp = lp - torch.logsumexp(lp, -1, keepdim=True) + head_mass.log()[:, None]  # the top-K hold 1 - tail
    inside = draft_index >= 0
    lp_s = lp.masked_fill(~inside, float("-inf"))
    log_z = torch.logsumexp(torch.cat([lp_s, tail_lp[:, None]], -1), -1, keepdim=True)  # mass of S
    p_log = lp_s - log_z
    q_log = draft_logp.gather(-1, draft_index.clamp(min=0))
    kl = torch.where(inside, p_log.exp() * (p_log - q_log), torch.zeros_like(p_log)).sum(-1)
    rest_q_log = torch.log(-torch.expm1(torch.logsumexp(q_log.masked_fill(~inside, float("-inf")), -1)
                                        .clamp(max=-1e-7)))
    tail_log = tail_lp - log_z[:, 0]
    tail = torch.where(tail_lp > -torch.inf, tail_log.exp() * (tail_log - rest_q_log), torch.zeros_like(tail_lp))
    p = torch.cat([p_log, tail_log[:, None]], -1).exp()  # (outside S: exp(-inf) = 0 on both sides)
    q = torch.cat([q_log.masked_fill(~inside, float("-inf")), rest_q_log[:, None]], -1).exp()
    return lk_mix(kl + tail, p, q, lk)


def _chunk(head: Eagle3Head, frozen: FrozenTarget, exact: bool, lk: bool, t2d: torch.Tensor, out: torch.Tensor,
           *teacher: torch.Tensor) -> torch.Tensor:
    """KL ``[c]`` (``lk``: the LK loss) of one chunk of rows: head outputs ``out [c, H]`` and the teacher's rows
    (exact: the target's pre-norm hidden ``[c, H]``; top-K: ``lp, ids [c, K]``, ``tail_lp [c]``)."""
    draft_logp = torch.log_softmax(head.draft_logits(out), -1)
    if exact:
        target = torch.log_softmax(frozen.logits(frozen.final_norm(teacher[0]))[:, head.draft_ids], -1)
        return lk_mix((target.exp() * (target - draft_logp)).sum(-1), target.exp(), draft_logp.exp(), lk)
    lp, ids, tail = teacher
    return restricted_kl(draft_logp, lp, t2d[ids], tail, lk)


@torch.no_grad()
def _top1(logits, x: torch.Tensor, vocab: int) -> torch.Tensor:
    """``argmax(logits(x))`` per row ``[n]``, ``chunk_rows(vocab)`` rows at a time."""
    parts = [logits(c).argmax(-1) for c in x.split(chunk_rows(vocab))]
    return torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.long)


def document_rows(cu_seqlens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed documents ``cu_seqlens [D+1]`` -> each row's index, its document's first row and the row past its
    document's last, ``[T]`` int64 each."""
    lengths = torch.tensor([b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], device=device)
    n = cu_seqlens[-1]
    starts = torch.tensor(cu_seqlens[:-1], device=device).repeat_interleave(lengths, output_size=n)
    return torch.arange(n, device=device), starts, starts + lengths.repeat_interleave(lengths, output_size=n)


def ttt_loss(head: Eagle3Head, frozen: FrozenTarget, batch: Batch, weights: LossWeights, forward=None,
             plan: TTTAttention | None = None) -> tuple[torch.Tensor, list[StepMetrics]]:
    """Weighted loss over the unrolled steps and per-step metrics (``forward``: the head as wrapped for DDP;
    ``plan``: the attention plan to run, whose step-0 keys a caller reads afterwards)."""
    forward = forward or head
    cu = batch.cu_seqlens
    n = batch.num_tokens
    rows, starts, ends = document_rows(cu, batch.tokens.device)
    positions = rows - starts
    t2d = vocab_index(head, frozen.cfg.vocab_size)
    plan = plan or TTTAttention(cu, head.spec.window)
    hidden, aux = None, batch.aux
    total = batch.hidden.new_zeros(())
    metrics: list[StepMetrics] = []
    for j in range(weights.unroll):
        label = rows + 2 + j
        valid = label < ends
        if j and not bool(valid.any()):  # (step 0 runs even then: DDP prepares its all-reduce in the forward)
            break
        token = torch.minimum(rows + 1 + j, ends - 1)  # past a document's end: its last token, never counted
        out = forward(frozen.embed(batch.tokens[token]), hidden, positions + j, plan, aux)
        hidden, aux = head.feedback_state(out), None  # what the next step reads, as chained drafting feeds it back
        counted = valid & batch.loss_mask[(label - weights.gate_offset).clamp(max=n - 1)]
        count = int(counted.sum())
        if count == 0:
            metrics.append(StepMetrics(out.new_zeros(()), 0, 0))
            continue
        step_loss, metric = draft_step_loss(head, frozen, batch, weights, t2d, out[counted], (rows + 1 + j)[counted])
        total = total + (weights.decay**j) * step_loss
        metrics.append(metric)
    return total, metrics


def vocab_index(head: Eagle3Head, vocab_size: int) -> torch.Tensor:
    """``t2d [V]``: each target id's index in the draft vocabulary, -1 where it holds none."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=head.draft_ids.device)
    t2d[head.draft_ids] = torch.arange(head.draft_ids.numel(), device=t2d.device)
    return t2d


def draft_step_loss(head: Eagle3Head, frozen: FrozenTarget, batch: Batch, weights: LossWeights, t2d: torch.Tensor,
                    picked: torch.Tensor, teacher_rows: torch.Tensor) -> tuple[torch.Tensor, StepMetrics]:
    """One draft step's loss over counted rows: head outputs ``picked [n, H]`` against the teacher stored at batch
    rows ``teacher_rows [n]`` (restricted to the draft vocabulary; rows whose target top-1 it lacks are left out of
    the loss and counted as misses) -> (the step's unweighted loss, its metrics)."""
    exact = weights.teacher == "exact"
    target_top1 = _top1(lambda h: frozen.logits(frozen.final_norm(h)), batch.hidden[teacher_rows],
                        frozen.cfg.vocab_size) if exact else batch.topk_ids[teacher_rows, 0]
    kept = t2d[target_top1] >= 0  # positions whose target top-1 the draft vocabulary holds
    teacher = [batch.hidden[teacher_rows]] if exact else [
        batch.topk_logprobs[teacher_rows], batch.topk_ids[teacher_rows], batch.tail_logprob[teacher_rows]]
    size = chunk_rows(head.draft_ids.numel())
    parts = [checkpoint(_chunk, head, frozen, exact, weights.lk, t2d, *c, use_reentrant=False,
                        preserve_rng_state=False)
             for c in zip(picked[kept].split(size), *(t[kept].split(size) for t in teacher))]
    kl = torch.cat(parts) if parts else picked.new_zeros(0)
    step_loss = weights.w_logits * kl.mean() if kl.numel() else picked.sum() * 0.0
    draft_top1 = head.draft_ids[_top1(head.draft_logits, picked, head.draft_ids.numel())]
    return step_loss, StepMetrics(step_loss.detach(), int((draft_top1 == target_top1).sum()), picked.shape[0])
