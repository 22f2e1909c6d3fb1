"""Sampling: greedy, temperature, top-k and top-p, with one seeded generator per request.

Every draw is made on the logits' device, for a whole batch at once: each request's generator (on the CPU, seeded
per request, so that a request's tokens do not depend on its batch) gives one uniform per draw on the host, the
batch's uniforms travel to the device in one copy, and the device inverts each row's cumulative distribution
(``draw``). No vocabulary-sized tensor is read on the host, and nothing waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.runtime.device import to_device


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


def target_distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits [N, V]``, row n decoded with ``params[n]`` -> ``[N, V]`` float32 (one call when all rows agree)."""
    if all(p == params[0] for p in params):
        return target_distribution(logits, params[0])
    return torch.cat([target_distribution(logits[n : n + 1], p) for n, p in enumerate(params)])


def uniforms(generators: list[torch.Generator | None], count: int) -> torch.Tensor:
    """``[N, count]`` float64 uniforms on the host: row n from ``generators[n]``, zeros where it is None (greedy)."""
    out = torch.zeros(len(generators), count, dtype=torch.float64)
    for n, gen in enumerate(generators):
        if gen is not None:
            out[n] = torch.rand(count, generator=gen, dtype=torch.float64)
    return out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (non-negative, not necessarily normalised) by inverting its CDF at
    ``u [N]`` float64 in [0, 1) -> ``[N]`` int64, on the device of ``probs``. A one-hot row gives its hot token
    whatever ``u``; a zero-probability token is never drawn."""
    cdf = probs.double().cumsum(-1)
    at = (u.to(cdf.device)[:, None] * cdf[:, -1:]).contiguous()
    token = torch.searchsorted(cdf, at, right=True)[:, 0]
    # u * total may round up to the total: then the last token of non-zero probability
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(token, last)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` -> ``[B]`` int64 on their device, row b drawn with ``generators[b]``
    (or at ``u [B]`` float64 on the device, drawn from them beforehand)."""
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    if u is None:
        u = to_device(uniforms(generators, 1)[:, 0], logits.device)
    return draw(target_distributions(logits, params), u)

