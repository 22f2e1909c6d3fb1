"""The decoder (Llama 2/3, Mistral, Qwen2, Qwen3; DeepSeek-V2/V3 through ``mla.py`` and ``moe.py``) over packed
tokens and paged KV.

Every forward takes a flat batch: ``tokens [T]`` and ``positions [T]`` of all sequences
concatenated, plus the step's attention plan. Family differences are options of one
module: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), sliding window (Mistral),
Llama 3 RoPE scaling. Under tensor parallelism each rank holds a slice of the heads and
of the MLP channels; the row-parallel projections are summed with an all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.models.config import ModelConfig
from mtp_train.models.mla import LatentAttention
from mtp_train.models.moe import MoE
from mtp_train.models.parts import (AttentionPlan, CosSin, FeedForward, KVPages, Linear, RMSNorm, decode_copies,
                                    scale_embeddings)
from mtp_train.models.rope import RotaryEmbedding
from mtp_train.models.tp import TensorParallel

__all__ = ["AttentionPlan", "CosSin", "DecoderLayer", "FeedForward", "KVPages", "RMSNorm", "Transformer"]


class Attention(nn.Module):
    """``window``: this layer's own sliding window where the model's layers differ (Gemma 3), passed to the plan."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.head_dim = cfg.head_dim
        self.n_heads = cfg.num_heads // tp.size
        self.n_kv_heads = cfg.num_kv_heads // tp.size
        self.tp = tp
        # q, k and v projections in one matmul: rows [q heads | k heads | v heads] of this rank.
        self.wqkv = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(self.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # Row-parallel bias is added once, after the all-reduce.
        self.wo_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin: CosSin, plan: AttentionPlan, kv: KVPages) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into the ``kv`` pages."""
        t = x.shape[0]
        qkv = self.wqkv(x).view(t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        qk, v = qkv.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = RotaryEmbedding.rotate(qk, *cos_sin).split([self.n_heads, self.n_kv_heads], dim=1)
        if self.window is None:
            out = plan.attend(q, k, v, kv[0], kv[1])
        else:
            out = plan.attend(q, k, v, kv[0], kv[1], window=self.window)
        out = out.reshape(t, self.n_heads * self.head_dim)
        out = self.tp.all_reduce(self.wo(out))
        return out if self.wo_bias is None else out + self.wo_bias

    def keys_values(self, x: torch.Tensor, cos_sin: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``forward`` makes of rows ``x [T, hidden]``, without queries or attention:
        ``[T, n_kv_heads, head_dim]`` each, keys normed and rotated (a DFlash head's context)."""
        rows = slice(self.n_heads * self.head_dim, None)
        bias = None if self.wqkv.bias is None else self.wqkv.bias[rows]
        kv = F.linear(x, self.wqkv.weight[rows], bias).view(x.shape[0], 2 * self.n_kv_heads, self.head_dim)
        k, v = kv.split([self.n_kv_heads, self.n_kv_heads], dim=1)
        return RotaryEmbedding.rotate(k if self.k_norm is None else self.k_norm(k), *cos_sin), v


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals (Gemma's with norms after each too, ``cfg.sandwich_norms``);
    DeepSeek's is latent attention, with experts when ``moe``. ``index``: the layer's place in the target (its
    sliding window and rope where they differ per layer, Gemma 3).

    ``decode_weights``: the layer's weights in the form a plan's ``run_layer`` takes to run the whole layer in one
    call (the runtime's CPU decode kernel sets it, ``runtime/small_batch.py``); the plan answers None for a step it
    does not run so, and the layer then runs op by op, as it always does inside ``parts.stored_layout()``.
    """

    decode_weights: object | None = None

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, moe: bool = False, index: int | None = None) -> None:
        super().__init__()
        window = cfg.layer_window(index) if cfg.layer_windows and index is not None else None
        self.local = window is not None and cfg.local_rope is not None  # rotates by the model's local rope
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.attention = LatentAttention(cfg, tp) if cfg.mla is not None else Attention(cfg, tp, window)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.feed_forward = MoE(cfg, tp) if moe else FeedForward(cfg, tp)
        self.post_attention_norm = self.post_ffn_norm = None
        if cfg.sandwich_norms:
            self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
            self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, cos_sin: CosSin, plan: AttentionPlan, kv: KVPages) -> torch.Tensor:
        run = getattr(plan, "run_layer", None) if self.decode_weights is not None and decode_copies() else None
        if run is not None and (out := run(x, self.decode_weights, cos_sin, kv)) is not None:
            return out
        if self.post_attention_norm is not None and self.post_ffn_norm is not None:
            h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos_sin, plan, kv))
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        h = x + self.attention(self.attention_norm(x), cos_sin, plan, kv)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (``output``), replicated except the layers."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        for n, what in ((cfg.num_heads, "attention heads"), (cfg.num_kv_heads, "KV heads")):
            tp.shard(n, what)
        tp.shard(cfg.intermediate_size, "MLP channels")
        if cfg.moe is not None:
            tp.shard(cfg.moe.intermediate_size, "expert channels")
        self.cfg = cfg
        self.tp = tp
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, cfg.is_moe_layer(i), i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.output = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.local_rope = None if cfg.local_rope is None else RotaryEmbedding(cfg.head_dim, cfg.local_rope)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: Sequence[KVPages],
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the decoder over packed ``tokens [T]`` at ``positions [T]``.

        Returns the last layer's output **before** the final norm ``[T, hidden]`` and the
        outputs of the layers listed in ``capture`` (0-based layer ids), each ``[T, hidden]``.
        """
        x = self.embed(tokens)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        local = cos_sin if self.local_rope is None else self.local_rope.cos_sin(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {}
        wanted = set(capture)
        for i, layer in enumerate(self.layers):
            x = layer(x, local if layer.local else cos_sin, plan, kv_cache[i])
            if i in wanted:
                captured[i] = x
        return x, [captured[i] for i in capture]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [T]`` -> the decoder's input ``[T, hidden]``: the embeddings, times ``cfg.embed_scale`` (Gemma's
        √hidden, rounded to the embeddings' dtype first, as HF does)."""
        return scale_embeddings(self.tok_embeddings(tokens), self.cfg.embed_scale)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` pre-norm states -> ``[T, vocab]`` float32 logits."""
        return self.output(self.norm(hidden)).float()
