"""The head's optimizer (``train.optimizer``).

``adamw``: AdamW over every trainable parameter. ``muon``: ``torch.optim.Muon`` (momentum orthogonalised by
Newton-Schulz iterations) over the head's hidden 2-D matrices, and AdamW over the rest: norms, biases, and the
vocabulary-sized matrices (a draft ``lm_head``, an embedding), which Muon practice leaves to AdamW (Keller Jordan's
Muon; speculators 0.9 trains its drafters so by default). Muon's update is scaled to AdamW's RMS
(``match_rms_adamw``), so one ``train.lr``, one ``train.weight_decay`` and one schedule serve both parts.
"""

from __future__ import annotations

from typing import Any

import torch

# 2-D parameters whose names hold one of these stay with AdamW (a vocabulary on one side)
VOCABULARY_NAMES = ("lm_head", "embed")
ADAMW_BETAS = (0.9, 0.95)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one optimizer: its ``param_groups`` are the two parts' own (Muon's first), so a
    scheduler or a caller setting ``lr`` sets it in both; its state dict holds each part's."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.parts = (muon, adamw)
        super().__init__([p for part in self.parts for g in part.param_groups for p in g["params"]], {})
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.parts[0].state_dict(), "adamw": self.parts[1].state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.parts[0].load_state_dict(state_dict["muon"])
        self.parts[1].load_state_dict(state_dict["adamw"])


def muon_split(head: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The head's trainable parameters as (Muon's, AdamW's): Muon takes the 2-D matrices with both sides above 1
    whose names hold none of ``VOCABULARY_NAMES``."""
    muon, adamw = [], []
    for name, p in head.named_parameters():
        if p.requires_grad:
            matrix = p.ndim == 2 and min(p.shape) > 1 and not any(v in name for v in VOCABULARY_NAMES)
            (muon if matrix else adamw).append(p)
    return muon, adamw


def build_optimizer(head: torch.nn.Module, kind: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``head``'s parameters (module docstring)."""
    if kind == "adamw":
        return torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS)
    muon, adamw = muon_split(head)
    return MuonAdamW(torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
                     torch.optim.AdamW(adamw, lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS))
