"""Attention over paged KV behind one interface: plan once per step, then write and attend per layer.

``torch`` (the CPU default) gathers each sequence's pages into a padded batch and calls SDPA
with a causal mask offset by the cached length. ``flashinfer`` (CUDA) uses FlashInfer's
paged prefill wrapper and ``append_paged_kv_cache``; it lives in ``flashinfer_backend.py``
and is imported only when selected.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from mtp_train.models.transformer import AttentionPlan
from mtp_train.runtime.batch import BatchMetadata


class AttentionBackend(Protocol):
    """Plans each step's attention; the plan (``models.transformer.AttentionPlan``) serves every layer."""

    def plan(self, meta: BatchMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionPlan: ...


class TorchStep:
    """SDPA over the pages, in one of two shapes.

    - A batch of fresh prefills (nothing cached before, full attention) needs no pages to be read:
      each sequence runs causal SDPA on its own new K/V, with no padding and no mask.
    - Otherwise each sequence's pages are gathered into a padded ``[B, Lmax]`` batch of keys for
      ``[B, Qmax]`` queries; the mask lets query i of sequence b (absolute position
      ``kv_len - q_len + i``) see keys at positions ``<= its own`` and, with a sliding window,
      ``> its own - window``.
    """

    def __init__(self, meta: BatchMetadata, sliding_window: int | None) -> None:
        dev = meta.tokens.device
        q_lens = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).long()
        kv_lens = meta.kv_lens.long()
        q_max, kv_max = int(q_lens.max()), int(kv_lens.max())
        num_tokens = meta.tokens.numel()
        self.slot_mapping = meta.slot_mapping
        self.fresh_bounds: list[int] | None = None
        if sliding_window is None and bool((q_lens == kv_lens).all()):
            self.fresh_bounds = meta.qo_indptr.tolist()
            return

        key_pos = torch.arange(kv_max, device=dev)
        page_slot = meta.page_indptr[:-1, None].long() + key_pos[None, :] // meta.page_size
        page_slot = page_slot.clamp(max=max(0, meta.page_indices.numel() - 1))
        key_valid = key_pos[None, :] < kv_lens[:, None]
        slots = meta.page_indices.long()[page_slot] * meta.page_size + key_pos[None, :] % meta.page_size
        self.kv_slots = torch.where(key_valid, slots, 0)  # [B, Lmax]

        self.uniform_q = int(q_lens.min()) == q_max  # decode, or verify with one k: no query padding
        q_idx = torch.arange(q_max, device=dev)
        self.q_valid = q_idx[None, :] < q_lens[:, None]  # [B, Qmax]
        self.q_rows = torch.where(self.q_valid, meta.qo_indptr[:-1, None].long() + q_idx[None, :], num_tokens)
        q_pos = kv_lens[:, None] - q_lens[:, None] + q_idx[None, :]  # [B, Qmax]
        mask = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        mask[:, :, 0] |= ~self.q_valid  # padded query rows see one key, so they stay finite
        # Additive float mask, built once per step rather than converted from bool in every layer.
        self.mask = torch.zeros(mask.shape, device=dev).masked_fill_(~mask, float("-inf"))[:, None]  # [B,1,Q,L]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        k_flat.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_flat.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        gqa = k.shape[1] != q.shape[1]
        if self.fresh_bounds is not None:
            b = self.fresh_bounds
            # 4-D [1, H, L, D] inputs take SDPA's fused CPU kernel; 3-D ones do not.
            parts = [
                F.scaled_dot_product_attention(
                    q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2), v[None, s:e].transpose(1, 2),
                    is_causal=True, enable_gqa=gqa,
                )[0].transpose(0, 1)
                for s, e in zip(b[:-1], b[1:])
            ]
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.uniform_q:
            q_pad = q.view(self.q_rows.shape[0], -1, *q.shape[1:])  # [B, Qmax, Hq, D]
        else:
            q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[self.q_rows]
        # index_select on the flat slots is several times faster than advanced indexing here.
        shape = (*self.kv_slots.shape, *k_flat.shape[1:])
        k_all = k_flat.index_select(0, self.kv_slots.view(-1)).view(shape)  # [B, Lmax, Hkv, D]
        v_all = v_flat.index_select(0, self.kv_slots.view(-1)).view(shape)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k_all.transpose(1, 2).to(q.dtype), v_all.transpose(1, 2).to(q.dtype),
            attn_mask=self.mask.to(q.dtype), enable_gqa=gqa,
        )
        out = out.transpose(1, 2)
        return out.reshape(-1, *out.shape[2:]) if self.uniform_q else out[self.q_valid]


class TorchAttention:
    """The portable backend; runs anywhere torch runs."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def plan(self, meta: BatchMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> TorchStep:
        return TorchStep(meta, self.sliding_window)


def select_backend(
    name: str, device: torch.device, sliding_window: int | None, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """``auto`` picks flashinfer on CUDA and torch elsewhere."""
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention(sliding_window)
    if name == "flashinfer":
        from mtp_train.errors import UserError

        if device.type != "cuda":
            raise UserError("target.attention_backend: flashinfer needs a CUDA device; use torch or auto on CPU")
        from mtp_train.runtime.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(device, sliding_window, dtype)
    raise ValueError(name)
