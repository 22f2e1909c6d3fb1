"""Rotary position embedding (half-rotation layout, as in HF Llama), with Llama 3.1 and YaRN frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from mtp_train.models.config import RopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other kinds)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def softmax_scale(head_dim: int, rope: RopeConfig) -> float:
    """Attention's softmax scale for a query/key dim ``head_dim``: ``head_dim ** -0.5``, times DeepSeek's
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = head_dim**-0.5
    if rope.kind == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _yarn(inv: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Blend interpolated (``inv / factor``) and original frequencies over a linear ramp between the dims
    where ``beta_fast`` and ``beta_slow`` rotations fit the original context (floored and ceiled, as HF does)."""
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = max(math.floor(dim_of(rope.beta_fast)), 0), min(math.ceil(dim_of(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return inv / rope.factor * (1 - keep) + inv * keep


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled per Llama 3.1 or YaRN as ``rope.kind`` says."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "yarn":
        return _yarn(inv, head_dim, rope)
    if rope.kind != "llama3":
        return inv
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, rope), persistent=False)
        self.scale = attention_factor(rope)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> ``cos, sin`` each ``[T, 1, head_dim]`` in ``dtype`` (times YaRN's attention factor)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, D]`` (queries and keys may be stacked along ``heads``)."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
