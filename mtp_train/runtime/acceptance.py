"""The speculative acceptance rule, as one pure function (Leviathan et al. 2023, Chen et al. 2023).

Draft token j is accepted with probability ``min(1, p_j(x) / q_j(x))``, where p is the target's
and q the draft's distribution at that position. At the first rejection the next token is drawn
from the residual ``max(p_j - q_j, 0)`` renormalised; if all k are accepted, a bonus token is
drawn from ``p_k``. The emitted tokens are then distributed exactly as the target's. With
one-hot (greedy) distributions this is argmax equality, and the bonus is the target's argmax.

``accept_draft`` decides one sequence on the host and is the reference; the runtime decides a whole batch on the
device with ``accept_batch`` (or ``accept_greedy``), the same rule from uniforms drawn beforehand.
"""

from __future__ import annotations

import torch

from mtp_train.runtime.sampling import draw


def accept_draft(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Decide one sequence's speculative step.

    Args:
        draft_tokens: ``[k]`` int64, the proposed tokens.
        draft_probs: ``[k, V]`` float, the draft distribution each token was drawn from.
        target_probs: ``[k + 1, V]`` float, the target distribution at each draft position and after the last.
        generator: source of the uniform draws (CPU).

    Returns:
        ``(num_accepted, next_token)``: the first ``num_accepted`` draft tokens are kept, then
        ``next_token`` (the residual sample at a rejection, or the bonus token) is appended.
    """
    k = draft_tokens.numel()
    for j in range(k):
        x = int(draft_tokens[j])
        p, q = float(target_probs[j, x]), float(draft_probs[j, x])
        if q > 0 and p >= q:
            continue
        u = float(torch.rand((), generator=generator))
        if q > 0 and u < p / q:
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else target_probs[j]
        return j, _draw(dist, generator)
    return k, _draw(target_probs[k], generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if float(probs.max()) == 1.0:  # one-hot: no randomness to spend
        return int(probs.argmax())
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def accept_batch(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    lens: torch.Tensor,
    u_accept: torch.Tensor,
    u_next: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of ``accept_draft`` for B sequences at once, on their device, from uniforms drawn beforehand.

    Args:
        draft_tokens: ``[B, k]`` int64; row b's first ``lens[b]`` are its drafts (the rest is padding).
        draft_probs: ``[B, k, V]`` float, the draft distribution each token was drawn from.
        target_probs: ``[B, k + 1, V]`` float, the target's distribution at each draft position and after
            the last one (row b's position ``lens[b]`` is its bonus).
        lens: ``[B]`` int64, drafts per sequence (<= k).
        u_accept: ``[B, k]`` float64 uniforms in [0, 1): draft j is kept when ``u * q(x) < p(x)``, i.e. with
            probability ``min(1, p(x) / q(x))``.
        u_next: ``[B]`` float64 uniforms in [0, 1) for the residual or bonus token (``sampling.draw``).

    Returns:
        ``num_accepted [B]`` and ``next_token [B]``, int64 on the device.
    """
    batch, k = draft_tokens.shape
    index = draft_tokens[..., None]
    p = target_probs[:, :k].gather(2, index)[..., 0].double()
    q = draft_probs.gather(2, index)[..., 0].double()
    position = torch.arange(k, device=draft_tokens.device)
    keep = (q > 0) & (u_accept * q < p) & (position[None] < lens[:, None])
    accepted = keep.long().cumprod(1).sum(1)  # [B]: the drafts before the first rejection
    rows = torch.arange(batch, device=draft_tokens.device)
    p_at = target_probs[rows, accepted]  # [B, V]
    if k:  # the draft at the rejected position; none after the last draft (then the bonus comes from p)
        q_at = draft_probs[rows, accepted.clamp(max=k - 1)] * (accepted < lens)[:, None]
    else:
        q_at = torch.zeros_like(p_at)
    residual = (p_at - q_at).clamp(min=0)
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return accepted, draw(dist, u_next)


def accept_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_batch`` for greedy targets and drafts (one-hot distributions): argmax equality.

    ``draft_tokens [B, k]``, ``target_argmax [B, k + 1]`` and ``lens [B]`` int64 -> ``num_accepted [B]`` and
    ``next_token [B]`` (the target's argmax after the kept drafts).
    """
    k = draft_tokens.shape[1]
    position = torch.arange(k, device=draft_tokens.device)
    keep = (draft_tokens == target_argmax[:, :k]) & (position[None] < lens[:, None])
    accepted = keep.long().cumprod(1).sum(1)
    return accepted, target_argmax.gather(1, accepted[:, None])[:, 0]
