"""The ``eagle`` head: EAGLE-1, the baseline that ``mtp`` must beat.

``fc(concat(embed(t_{i+1}), h_i))``, then decoder layer(s) whose first has no input norm, and no
final norm: the frozen lm_head reads the output directly. Following EAGLE's convention it consumes
the target's hidden state **after** the final norm (the features the lm_head reads) and predicts
the next such state.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.heads.base import DraftHead, HeadSpec
from mtp_train.models.parts import Linear


class EagleHead(DraftHead):
    kind = "eagle"

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__(spec)
        h = spec.target.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.layers[0].attention_norm = nn.Identity()

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, hidden], dim=-1))

    def lm_head_input(self, out: torch.Tensor) -> torch.Tensor:
        return out
