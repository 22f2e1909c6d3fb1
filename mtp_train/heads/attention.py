"""Attention for head training: causal within each packed document, no KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DocumentCausalAttention:
    """A step plan for ``models.transformer.Attention`` over packed documents.

    ``cu_seqlens [D+1]`` are document offsets into the packed tokens; query i attends to keys
    j <= i of its own document only.
    """

    def __init__(self, cu_seqlens: list[int]) -> None:
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``[T, Hq, D]``."""
        gqa = k.shape[1] != q.shape[1]
        parts = [
            F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2), v[None, s:e].transpose(1, 2),
                is_causal=True, enable_gqa=gqa,
            )[0].transpose(0, 1)
            for s, e in self.bounds
        ]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor, cache, v_dim: int, scale: float) -> torch.Tensor:
        """MLA, absorbed: ``q [T, H, D]`` against ``latent [T, 1, D]`` (its first ``v_dim`` channels the value)
        -> ``[T, H, v_dim]``."""
        parts = [
            F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2), latent[None, s:e].transpose(1, 2),
                latent[None, s:e, :, :v_dim].transpose(1, 2), is_causal=True, enable_gqa=True, scale=scale,
            )[0].transpose(0, 1)
            for s, e in self.bounds
        ]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
