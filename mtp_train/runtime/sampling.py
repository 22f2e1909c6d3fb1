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
        logits = _nucleus(logits, params.top_p)
    return logits.softmax(-1)


def _nucleus(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` float32 with the tokens outside each row's top-p nucleus set to -inf; ``top_p`` is one
    float or ``[N, 1]`` float32 (``inf`` keeps a row whole)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    # Drop a token when the mass before it already reaches top_p; the top token always stays.
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


@dataclass(frozen=True)
class RowSettings:
    """Each row's sampling settings as ``[N, 1]`` tensors on the logits' device, built from the requests'
    ``SamplingParams`` on the host and moved in one copy (the device is never read).

    A setting that is off takes the value that leaves its row untouched, so every row goes through the same ops:
    temperature 1 on greedy rows (whose result is replaced by their one-hot), a top-k threshold of -inf, a top-p
    of inf."""

    temperature: torch.Tensor  # [N, 1] float32
    greedy: torch.Tensor  # [N, 1] bool
    top_k_rank: torch.Tensor  # [N, 1] int64: the index of the k-th largest logit (0 where top-k is off)
    top_k_on: torch.Tensor  # [N, 1] bool
    top_p: torch.Tensor  # [N, 1] float32

    @staticmethod
    def of(params: list[SamplingParams], vocab: int, device: torch.device) -> RowSettings:
        # Only the fields that shape the distribution are read: seeds, lengths and stop tokens never matter here.
        host = torch.tensor([[1.0 if p.greedy else p.temperature, float(p.greedy),
                              p.top_k - 1 if 0 < p.top_k < vocab else 0, float(0 < p.top_k < vocab),
                              p.top_p if p.top_p < 1.0 else float("inf")] for p in params], dtype=torch.float64)
        rows = to_device(host, device)
        return RowSettings(temperature=rows[:, 0:1].float(), greedy=rows[:, 1:2] > 0, top_k_rank=rows[:, 2:3].long(),
                           top_k_on=rows[:, 3:4] > 0, top_p=rows[:, 4:5].float())


def target_distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits [N, V]``, row n decoded with ``params[n]`` -> ``[N, V]`` float32, all rows in one batched pass.

    Row n is ``target_distribution(logits[n : n + 1], params[n])``, whatever the other rows: on the CPU bit for
    bit (the same ops per row); on CUDA a scaled logit may differ in its last bit, since torch's kernel divides
    by a host scalar (there) as a product with its reciprocal and by a tensor (here) with a true division.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    hot = None
    if any(p.greedy for p in params):
        hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        if all(p.greedy for p in params):
            return hot
    rows = RowSettings.of(params, vocab, logits.device)
    logits = logits / rows.temperature
    ranks = [p.top_k for p in params if 0 < p.top_k < vocab]
    if ranks:  # one top-k for all rows: the k-th largest value is the same whichever larger k found it
        kth = torch.topk(logits, max(ranks), dim=-1).values.gather(-1, rows.top_k_rank)
        kth = kth.masked_fill(~rows.top_k_on, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        logits = _nucleus(logits, rows.top_p)
    probs = logits.softmax(-1)
    return probs if hot is None else torch.where(rows.greedy, hot, probs)


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

