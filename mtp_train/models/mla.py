"""Multi-head latent attention (DeepSeek-V2/V3) over paged latent KV, in the absorbed form.

Per token the cache holds one shared vector: the normed ``kv_lora_rank`` latent ``c`` and the rotated
``qk_rope_head_dim`` rope key, never the per-head K and V. Head h's key and value are ``W_UK[h] c`` and
``W_UV[h] c`` (the two halves of ``kv_b_proj``), so the query's no-rope part is absorbed into latent space,
``q_nope[h] W_UK[h]``, attention runs as one-key-head attention over ``[c | k_rope]`` with ``c`` as its value, and
``W_UV`` is applied to the result. Every step (prefill, decode, verify) takes this form: it reads only the latent
pages, and the non-absorbed prefill, cheaper in arithmetic for long prompts, is not built here.

Under tensor parallelism each rank owns a slice of the heads (``q``, ``kv_b`` rows, ``o_proj`` columns); the latent
projection and its cache are replicated, as MLA's per-token cache has no head dimension to split.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.models.config import ModelConfig
from mtp_train.models.rope import RotaryEmbedding, softmax_scale
from mtp_train.models.tp import TensorParallel
from mtp_train.models.parts import CosSin, KVPages, RMSNorm


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.mla = mla
        self.n_heads = cfg.num_heads // tp.size
        self.tp = tp
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(cfg.hidden_size, self.n_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, 1e-6)  # HF builds these norms with the default eps
            self.wq_b = nn.Linear(mla.q_lora_rank, self.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * mla.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = softmax_scale(qk_dim, cfg.rope)

    def _rope(self, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
        if self.mla.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> evens then odds, the half-rotation layout
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return RotaryEmbedding.rotate(x, *cos_sin)

    def forward(self, x: torch.Tensor, cos_sin: CosSin, plan, kv: KVPages) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this step's latents into ``kv[0]`` (``[pages, page, 1, D]``)."""
        m, t = self.mla, x.shape[0]
        q = self.wq(x) if m.q_lora_rank is None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(t, self.n_heads, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rope = self.wkv_a(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = torch.cat([self.kv_a_norm(c)[:, None, :], self._rope(k_rope[:, None, :], cos_sin)], dim=-1)  # [T, 1, D]
        w = self.wkv_b.weight.view(self.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)  # [H, nope, lora], [H, v, lora]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, lora]
        query = torch.cat([q_latent, self._rope(q_rope, cos_sin)], dim=-1)
        out = plan.attend_latent(query, latent, kv[0], m.kv_lora_rank, self.scale)  # [T, H, lora]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.tp.all_reduce(self.wo(out.reshape(t, self.n_heads * m.v_head_dim)))
