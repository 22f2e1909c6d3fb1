"""The speculative acceptance rule, as one pure function (Leviathan et al. 2023, Chen et al. 2023).

Draft token j is accepted with probability ``min(1, p_j(x) / q_j(x))``, where p is the target's
and q the draft's distribution at that position. At the first rejection the next token is drawn
from the residual ``max(p_j - q_j, 0)`` renormalised; if all k are accepted, a bonus token is
drawn from ``p_k``. The emitted tokens are then distributed exactly as the target's. With
one-hot (greedy) distributions this is argmax equality, and the bonus is the target's argmax.
"""

from __future__ import annotations

import torch


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
