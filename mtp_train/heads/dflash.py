"""The ``dflash`` head: a block drafter (DFlash, arXiv 2602.06036) that drafts k tokens in one forward.

``fc`` and ``hidden_norm`` turn the target's states at ``aux_layers`` (numbered, defaulted and concatenated as
eagle3's, ``[T, nH]``) into context rows ``c [T, H]``. Every decoder layer makes the context's keys and values from
``c`` alone: its own k and v projections, ``k_norm`` and RoPE at the context's positions on the keys, no input norm.
A block ``[t_a, m, ..., m]`` at positions ``a..a+B-1`` (``m``: the head's trained mask vector) then runs through the
layers as any tokens do, each query attending to the context before ``a`` and to every position of its block (not
causal). The final ``norm`` and the target's frozen lm_head turn block position j into the draft of t_{a+j}.

The layers are Qwen3's (per-head RMSNorm on queries and keys, no biases) whatever the target's family, as vLLM's
DFlash loader builds them (``docs/export.md``, "DFlash in vLLM"); their shapes and RoPE are the target's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from mtp_train.errors import UserError
from mtp_train.heads.base import DraftHead, HeadSpec
from mtp_train.models.config import ModelConfig
from mtp_train.models.parts import Linear, RMSNorm


class DFlashHead(DraftHead):
    kind = "dflash"

    def __init__(self, spec: HeadSpec) -> None:
        cfg = spec.target
        if cfg.mla is not None or spec.moe:
            raise UserError(f"head: a dflash head's layers are standard attention; the {cfg.family} target's latent "
                            "attention is not what vLLM's DFlash layer is built from (use head.kind=mtp)")
        if spec.block_size < 2:
            raise UserError(f"head.block_size: {spec.block_size} must be at least 2 (the first token and one mask)")
        if not 0 <= spec.mask_token_id < cfg.vocab_size:
            raise UserError(f"head.mask_token_id: {spec.mask_token_id} is not an id of the target's vocabulary "
                            f"(0..{cfg.vocab_size - 1})")
        super().__init__(spec)
        h = cfg.hidden_size
        self.fc = Linear(len(spec.aux_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))  # the trainer starts it at the target's mask_token_id row

    def layer_config(self) -> ModelConfig:
        return replace(self.spec.target.plain_layer(), qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False,
                       sliding_window=None)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's states at the aux layers, concatenated ``[T, nH]`` -> context rows ``c [T, H]``."""
        return self.hidden_norm(self.fc(aux))

    def block_embeds(self, first: torch.Tensor, size: int) -> torch.Tensor:
        """Embeddings of the blocks' first tokens ``[A, H]`` -> the blocks' inputs ``[A * size, H]``."""
        masks = self.mask_embedding.to(first.dtype).expand(first.shape[0], size - 1, first.shape[1])
        return torch.cat([first[:, None], masks], dim=1).flatten(0, 1)

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor | None, positions: torch.Tensor, plan, kv: list,
            context: tuple | None = None) -> torch.Tensor:
        """Blocks ``embeds [T, H]`` at ``positions [T]`` through the layers with ``plan`` (the runtime's: non-causal
        over the pages) -> output ``[T, H]``. ``context``: ``(rows [C, H], positions [C], write plan)`` not yet in
        the pages, each layer's keys and values of them written just before that layer runs (the step's one draft
        forward); None where the pages hold the context already. ``hidden`` is unused (no chain)."""
        x = embeds
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        if context is not None:
            rows, at, write = context
            at_cos_sin = self.rope.cos_sin(at, rows.dtype)
        for layer, cache in zip(self.layers, kv, strict=True):
            if context is not None:
                write.write(*layer.attention.keys_values(rows, at_cos_sin), *cache)
            x = layer(x, cos_sin, plan, cache)
        return x

    def forward(self, first: torch.Tensor, aux: torch.Tensor, context_positions: torch.Tensor,
                block_positions: torch.Tensor, plan) -> torch.Tensor:
        """Training: blocks whose first tokens embed to ``first [A, H]``, at ``block_positions [A * B]``, over the
        context of ``aux [T, nH]`` at ``context_positions [T]`` -> output ``[A * B, H]``. ``plan`` takes each layer's
        context keys and values (``plan.context``) before the layer runs."""
        context = self.project(aux)
        ctx_cos_sin = self.rope.cos_sin(context_positions, context.dtype)
        x = self.block_embeds(first, self.spec.block_size)
        cos_sin = self.rope.cos_sin(block_positions, x.dtype)
        for layer in self.layers:
            plan.context = layer.attention.keys_values(context, ctx_cos_sin)
            x = layer(x, cos_sin, plan, (None, None))
        return x

    def lm_head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)
