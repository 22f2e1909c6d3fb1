"""DeepSeek's mixture of experts: a router, routed experts and always-on shared experts.

Routing (``MoEConfig``): V2 scores experts with a softmax and takes the top k (optionally within the best groups,
a group scored by its best expert); V3 scores with a sigmoid, chooses by score plus a learned per-expert
correction bias within the ``topk_group`` best groups (a group scored by the sum of its best two), weights the
chosen experts by their plain scores, renormalised when ``norm_topk_prob``; both scale by
``routed_scaling_factor``. The router runs in float32 whatever the model's dtype, as HF keeps it.

Under tensor parallelism every rank holds every expert, sliced by channel like the dense MLP (rows of each
expert's gate/up, columns of its down projection): routing is replicated, and one all-reduce sums the routed and
shared outputs. Expert weights are stacked: ``w_gate_up [E * 2I, H]`` (expert-major, gate then up) and
``w_down [E * H, I]``.

The (token, expert) pairs are sorted by expert and go through two grouped matmuls (``torch._grouped_mm``) whose
group sizes never leave the device, so a decode step neither waits for the host nor loops over the experts; where
that kernel is missing, a loop over the experts reads the group sizes once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.models.config import ModelConfig, MoEConfig
from mtp_train.models.parts import FeedForward
from mtp_train.models.tp import TensorParallel

log = logging.getLogger(__name__)


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden))  # kept float32 by the loader
        self.bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.scoring == "sigmoid" else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> the chosen experts' ``weights [T, k]`` float32 and ``ids [T, k]``."""
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if m.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.bias is None else scores + self.bias.float()
        if m.group_limited:
            grouped = choice.view(-1, m.n_group, m.num_experts // m.n_group)
            group_score = grouped.max(-1).values if self.bias is None else grouped.topk(2, dim=-1).values.sum(-1)
            groups = group_score.topk(m.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep[:, :, None].expand_as(grouped).reshape(-1, m.num_experts)
            # Softmax scores outside the chosen groups become 0 (as HF does), sigmoid choices -inf.
            choice = choice.masked_fill(~keep, 0.0 if self.bias is None else float("-inf"))
        ids = choice.topk(m.experts_per_token, dim=-1, sorted=False).indices
        weights = (choice if self.bias is None else scores).gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe = moe
        self.tp = tp
        self.inter = moe.intermediate_size // tp.size
        self.router = Router(cfg.hidden_size, moe)
        self.w_gate_up = nn.Parameter(torch.zeros(moe.num_experts * 2 * self.inter, cfg.hidden_size))
        self.w_down = nn.Parameter(torch.zeros(moe.num_experts * cfg.hidden_size, self.inter))
        shared = moe.intermediate_size * moe.num_shared_experts
        self.shared = FeedForward(cfg, tp, shared, reduce=False) if shared else None
        self.no_grouped_mm = False  # set once torch's grouped matmul failed on this device or dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``: each token through its k experts, weighted, plus the shared experts."""
        weights, ids = self.router(x)
        flat = ids.view(-1)
        order = flat.argsort(stable=True)
        tokens = order // ids.shape[1]  # the token of each (token, choice) pair, grouped by expert
        rows = x.index_select(0, tokens)  # [P, H], P = T * k
        y = self._grouped(rows, flat) if self._can_group(x) else self._looped(rows, flat)
        y = y * weights.view(-1)[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        if self.shared is not None:
            out = out + self.shared(x)
        return self.tp.all_reduce(out)

    def _can_group(self, x: torch.Tensor) -> bool:
        """Whether torch's grouped matmul takes these shapes: rows of 16-byte multiples (its alignment)."""
        return (hasattr(torch, "_grouped_mm") and not self.no_grouped_mm
                and all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], self.inter)))

    def _grouped(self, rows: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """``rows [P, H]`` sorted by expert (``flat [P]`` the expert of each before sorting) through their experts
        -> ``[P, H]``: two grouped matmuls whose group sizes stay on the device (no host sync, no loop)."""
        E = self.moe.num_experts
        counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        gate_up = self.w_gate_up.view(E, 2 * self.inter, -1).transpose(1, 2)  # [E, H, 2I], column-major
        down = self.w_down.view(E, -1, self.inter).transpose(1, 2)  # [E, I, H]
        try:
            g, u = torch._grouped_mm(rows, gate_up, offs=ends).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(g) * u, down, offs=ends)
        except (RuntimeError, NotImplementedError) as err:  # a device or dtype without the kernel: loop from now on
            log.warning("MoE: torch._grouped_mm failed on %s %s (%s); the experts run in a loop", rows.device,
                        rows.dtype, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            self.no_grouped_mm = True
            return self._looped(rows, flat)

    def _looped(self, rows: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """``_grouped`` as a loop over the experts, reading the group sizes on the host (one sync)."""
        gate_up = self.w_gate_up.view(self.moe.num_experts, 2 * self.inter, -1)
        down = self.w_down.view(self.moe.num_experts, -1, self.inter)
        out, start = [], 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.moe.num_experts).tolist()):
            if n:
                g, u = F.linear(rows[start : start + n], gate_up[e]).chunk(2, dim=-1)
                out.append(F.linear(F.silu(g) * u, down[e]))
                start += n
        return torch.cat(out)
