"""Sampling: greedy, temperature, top-k and top-p, with one seeded generator per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off.

    ``stop_token_ids=None`` stops at the model's end-of-sequence tokens; ``()`` never stops early.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [N, V]`` -> the distribution ``[N, V]`` float32 that sampling draws from.

    Greedy gives a one-hot at the argmax, so the speculative acceptance rule reduces to argmax equality.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` -> ``[B]`` int64, row b drawn with ``generators[b]``."""
    out = logits.argmax(-1)
    for b, p in enumerate(params):
        if not p.greedy:
            probs = target_distribution(logits[b : b + 1], p)
            out[b] = torch.multinomial(probs.cpu(), 1, generator=generators[b])[0, 0]
    return out
