"""The ``eagle3`` head: EAGLE-3, over three target layers and a draft vocabulary of its own.

``fc`` projects the target's residual-stream states at three layers (``aux_layers``, each the input of that decoder
block, as vLLM and SGLang number them; concatenated in ascending order, ``[T, 3H]``) to ``g [T, H]``. One decoder
layer attends over ``[input_layernorm(embed(t_{i+1})) | hidden_norm(g)]`` (``2H`` wide, so its q/k/v projections
read ``2H``) with ``g`` as the residual; a final ``norm`` and the head's own ``lm_head`` over ``draft_vocab`` target
ids (``draft_ids``, ascending) give the draft logits. A chained step feeds back the layer's output before ``norm``
in place of ``g`` (``fc`` applies to the target's states only), as vLLM, SGLang and SpecForge do (EXPORT.md 3.3).

EAGLE 3.1's two options, as speculators, vLLM 0.32 and SGLang 0.5.23 name and place them: ``spec.fc_norm`` gives
each aux layer's state an RMSNorm of its own before ``fc`` (``fc_norm.{0,1,2}``, each ``[H]``); ``norm_output``
feeds back the output after the final ``norm`` (what the logits read) instead of before it: the spec's ``feedback:
head_norm``, which ``DraftHead.feedback_state`` applies through ``lm_head_input``.

vLLM's and speculators' two more (``spec.norm_before_fc``, ``spec.norm_before_residual``, speculators' defaults): one
RMSNorm over the whole aux concatenation before ``fc`` (``input_norm [3H]``, before any ``fc_norm``), and the
decoder layer's residual taken after ``hidden_norm`` instead of before it.

P-EAGLE (``spec.parallel_drafts`` = K, vLLM's ``parallel_drafting``): K - 1 mask positions follow the last
verified position's row in the same forward, each reading the frozen embedding of ``mask_token_id`` and ``fc`` of a
trained ``mask_hidden [3H]`` (vLLM's name and place: the aux concatenation the target's states would fill), so that
one forward drafts K tokens; no state is fed back.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.errors import UserError
from mtp_train.heads.base import DraftHead, HeadSpec
from mtp_train.models.config import ModelConfig
from mtp_train.models.parts import Linear, RMSNorm, decode_copies


def default_aux_layers(cfg: ModelConfig) -> list[int]:
    """The engines' default aux layers ``[2, L//2, L-3]``, inputs of those blocks (EXPORT.md 3.4); refused, with what
    to do, where a shallow target makes them repeat."""
    n = cfg.num_layers
    ids = [2, n // 2, n - 3]
    if len(set(ids)) != 3 or ids != sorted(ids) or ids[0] < 1:
        raise UserError(f"head.aux_layers: the engines' default {ids} for a {n}-layer target is not three distinct "
                        f"ascending layers; set head.aux_layers to three ids in 1..{n}, e.g. "
                        f"[{max(1, n - 2)}, {max(2, n - 1)}, {max(3, n)}]")
    return ids


def aux_layers_for(requested: list[int] | None, cfg: ModelConfig) -> list[int]:
    """``head.aux_layers`` checked against the target, or the engines' default when it is null."""
    if requested is None:
        return default_aux_layers(cfg)
    ids = list(requested)
    if len(ids) != 3 or ids != sorted(set(ids)) or not all(1 <= i <= cfg.num_layers for i in ids):
        raise UserError(f"head.aux_layers: {ids} must be three distinct ascending ids in 1..{cfg.num_layers} "
                        f"(id k is the output of decoder layer k - 1, the input of block k; {cfg.num_layers}: the last "
                        "layer's output, before the final norm)")
    return ids


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__(spec)
        cfg = spec.target
        if spec.num_layers != 1 or cfg.mla is not None or spec.moe:
            raise UserError("head: an eagle3 head has one decoder layer of a target with standard attention "
                            f"(head.num_layers 1; the {cfg.family} target's {'latent attention' if cfg.mla else 'layers'} "
                            "are not what EAGLE-3's layer is built from)")
        h = cfg.hidden_size
        self.fc = Linear(len(spec.aux_layers) * h, h, bias=False)
        if spec.fc_norm:  # EAGLE 3.1: one norm per aux layer's state, so that each enters fc at one scale
            self.fc_norm = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in spec.aux_layers)
        if spec.norm_before_fc:  # one norm over the concatenation, as vLLM's ``input_norm``
            self.input_norm = RMSNorm(len(spec.aux_layers) * h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        attn = self.layers[0].attention
        attn.wqkv = Linear(2 * h, attn.wqkv.out_features, bias=cfg.qkv_bias)  # reads [embed | hidden], 2H
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, spec.draft_vocab, bias=False)
        self.register_buffer("draft_ids", torch.arange(spec.draft_vocab))  # [N] target ids, ascending
        if spec.parallel_drafts:  # P-EAGLE: the aux states of a mask position, drawn small (fc and norms scale it)
            self.mask_hidden = nn.Parameter(torch.randn(len(spec.aux_layers) * h) * 0.02)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's states at the aux layers, concatenated ``[T, 3H]`` -> ``g [T, H]`` (with ``fc_norm``: each
        ``[T, H]`` part normed by its own norm first; with ``norm_before_fc``, the whole normed before that)."""
        if self.spec.norm_before_fc:
            aux = self.input_norm(aux)
        if self.spec.fc_norm:
            parts = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(aux)

    def mask_state(self) -> torch.Tensor:
        """P-EAGLE: a mask position's hidden input ``[1, H]``, ``project`` of ``mask_hidden``."""
        return self.project(self.mask_hidden[None])

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor | None, positions: torch.Tensor, plan,
                aux: torch.Tensor | None = None) -> torch.Tensor:
        """One training step over packed documents with the step's attention ``plan`` (training-time test): the
        first reads ``fc`` of the target's states ``aux [T, 3H]``, the later ones a fed-back ``hidden [T, H]``."""
        if aux is not None:
            hidden = self.project(aux)
        return self.run(embeds, hidden, positions, plan, [(None, None)])

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, plan, kv: list) -> torch.Tensor:
        """``embeds [T, H]`` and ``hidden [T, H]`` (``project``'s output, or a fed-back state) -> output ``[T, H]``."""
        layer = self.layers[0]
        cos_sin = self.rope.cos_sin(positions, hidden.dtype)
        normed = self.hidden_norm(hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        x = torch.cat([layer.attention_norm(embeds), normed], dim=-1)
        run = getattr(plan, "run_layer", None) if layer.decode_weights is not None and decode_copies() else None
        if run is not None and (out := run(residual, layer.decode_weights, cos_sin, kv[0], attention_input=x)) is not None:
            return out  # the runtime's CPU kernel: the layer in one call (runtime/small_batch.py)
        h = residual + layer.attention(x, cos_sin, plan, kv[0])
        return h + layer.feed_forward(layer.ffn_norm(h))

    def lm_head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output ``[T, H]`` -> logits over the draft vocabulary ``[T, N]`` (float32)."""
        return self.lm_head(self.norm(out)).float()
