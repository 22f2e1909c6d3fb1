"""The ``mtp`` head: DeepSeek-V3's multi-token-prediction module with its RMSNorms.

``enorm(embed(t_{i+1}))`` and ``hnorm(h_i)`` are concatenated and projected by ``eh_proj``,
then run through decoder layer(s) of the target's family (with both of their norms); the frozen
lm_head reads ``shared_head.norm`` of the output. In the ``native`` convention it consumes the
target's hidden state **before** the final norm, and its raw output is what the next unrolled step
consumes as h; the ``vllm`` and ``sglang`` conventions read the state after the final norm and feed
back ``shared_head.norm`` of the output, as those engines do (:mod:`mtp_train.heads.conventions`).
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.heads.base import DraftHead, HeadSpec
from mtp_train.models.parts import Linear, RMSNorm


class SharedHead(nn.Module):
    """DeepSeek's name for the final norm before the (shared, frozen) lm_head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPHead(DraftHead):
    kind = "mtp"

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__(spec)
        h, eps = spec.target.hidden_size, spec.target.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, eps)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def lm_head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(out)
