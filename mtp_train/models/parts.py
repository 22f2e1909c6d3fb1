"""Pieces every decoder module shares: RMSNorm, the step's attention plan, and the types passed between layers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.models.config import ModelConfig
from mtp_train.models.tp import TensorParallel

CosSin = tuple[torch.Tensor, torch.Tensor]  # RoPE cos and sin at each token's position
KVPages = tuple[torch.Tensor, torch.Tensor]  # one layer's K and V pages


class AttentionPlan(Protocol):
    """One step's attention over paged KV, planned by the runtime's backend; the same plan serves every layer."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's ``k, v [T, Hkv, D]`` in the layer's pages, then attend: ``q [T, Hq, D]`` -> ``[T, Hq, D]``."""
        ...

    def attend_latent(
        self, q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, v_dim: int, scale: float
    ) -> torch.Tensor:
        """MLA: store ``latent [T, 1, D]`` in the layer's pages, then attend ``q [T, H, D]`` with the latents as keys and
        their first ``v_dim`` channels as values, at softmax scale ``scale`` -> ``[T, H, v_dim]``."""
        ...


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Gemma's RMSNorm of ``x [..., D]``: statistics and the scale by ``offset + weight`` in fp32, as HF computes
    them, then cast back to ``x``'s dtype."""
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return (normed * (offset + weight.float())).to(x.dtype)


def scale_embeddings(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Embeddings ``x [T, H]`` times ``scale`` (Gemma's √hidden), rounded to ``x``'s dtype first, as HF does."""
    return x if scale == 1.0 else x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm scaling by ``weight``, or by ``offset + weight`` (Gemma's ``1 + weight``, computed in fp32 as HF
    does)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return offset_rms_norm(x, self.weight, self.eps, self.offset)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Low precision: statistics in fp32, then scale in the input dtype, as HF does.
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


_DECODE_COPIES = ContextVar("decode_copies", default=True)


@contextmanager
def stored_layout() -> Iterator[None]:
    """Inside, every :class:`Linear` multiplies by its stored weight (``F.linear``) and every decoder layer runs op
    by op: neither the copies ``runtime/small_batch.py``'s timing chose in this process nor the one-call CPU layers
    are used, so the results are torch's alone for a given batch. The engine's ``score`` runs so, and the features
    are the same bits in every process (offline, online, a resumed task) whatever the row count."""
    token = _DECODE_COPIES.set(False)
    try:
        yield
    finally:
        _DECODE_COPIES.reset(token)


def decode_copies() -> bool:
    """False inside ``stored_layout()``."""
    return _DECODE_COPIES.get()


class Linear(nn.Linear):
    """``nn.Linear`` that may multiply a few rows another way: ``small_rows`` maps a row count to a product
    ``x [rows, in] -> [rows, out]`` over a copy of the weight (not in the state dict) that reads faster at that
    count on CPU; ``runtime/small_batch.py`` measures which counts and copies pay. Same product either way, up to
    rounding. Rows that require grad, and every row inside ``stored_layout()``, take ``F.linear``."""

    small_rows: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.small_rows and x.dim() == 2 and not x.requires_grad and decode_copies()
                and (product := self.small_rows.get(x.shape[0]))):
            y = product(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class FeedForward(nn.Module):
    """The gated MLP (SiLU, or Gemma's tanh-approximated GELU: ``cfg.activation``); ``reduce=False`` leaves the
    all-reduce to the caller (DeepSeek's shared experts)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, intermediate: int | None = None,
                 reduce: bool = True) -> None:
        super().__init__()
        inter = (intermediate or cfg.intermediate_size) // tp.size
        self.tp = tp if reduce else TensorParallel()
        self.w_gate_up = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)  # rows [gate | up]
        self.w_down = Linear(inter, cfg.hidden_size, bias=False)
        self.w_down_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.mlp_bias else None
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out = self.tp.all_reduce(self.w_down(act * up))
        return out if self.w_down_bias is None else out + self.w_down_bias
