"""FlashInfer attention on CUDA: paged prefill/append wrapper (plan once per step, run per layer).

Imported only when the flashinfer backend is selected. Every batch kind (prefill, decode, verify, a DFlash block,
which is not causal, a tree with its custom mask) is an "append" over paged KV, so one wrapper serves them all.
Index arrays are int32; the plan takes
the per-sequence arrays from the host (``BatchMetadata.host_*``) and the page indices from the device.
"""

from __future__ import annotations

import torch

from mtp_train.runtime.batch import BatchMetadata

# FlashInfer's float workspace, which its split-KV plans fill: 128 MiB is a known overflow at 32 query heads on an
# H100's 132 SMs.
WORKSPACE_BYTES = 512 * 1024 * 1024


class FlashInferStep:
    def __init__(self, backend: FlashInferAttention, meta: BatchMetadata, num_heads: int, num_kv_heads: int,
                 head_dim: int, causal: bool = True) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.meta = meta
        # The indptr arrays from the host (pinned): ``plan`` reads them there, and copying them back from the
        # device would make the host wait for the queue in every step.
        backend.wrapper.plan(
            meta.host_qo_indptr,
            meta.host_page_indptr,
            meta.page_indices,
            meta.host_last_page_len,
            num_heads,
            num_kv_heads,
            head_dim,
            meta.page_size,
            causal=causal and meta.tree is None,
            custom_mask=None if meta.tree is None else _custom_mask(meta),
            window_left=-1 if backend.sliding_window is None else backend.sliding_window - 1,
            q_data_type=backend.dtype,
            kv_data_type=backend.dtype,
        )
        self.wrapper = backend.wrapper
        self.batch_indices, self.positions = flashinfer.get_batch_indices_positions(
            meta.qo_indptr, meta.kv_lens, meta.tokens.numel()
        )

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Store ``k``/``v [T, Hkv, D]`` at the step's positions in the pages, attending nothing."""
        self._flashinfer.append_paged_kv_cache(
            k.to(k_cache.dtype), v.to(v_cache.dtype), self.batch_indices, self.positions, (k_cache, v_cache),
            self.meta.page_indices, self.meta.page_indptr, self.meta.last_page_len, kv_layout="NHD",
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        self.write(k, v, k_cache, v_cache)
        return self.wrapper.run(q.to(k_cache.dtype), (k_cache, v_cache)).to(q.dtype)


def _custom_mask(meta: BatchMetadata) -> torch.Tensor:
    """A tree's mask as FlashInfer's ``custom_mask``: each sequence's ``[q_len, kv_len]`` bool, flattened, in order
    (every query sees the context before ``prefix``, then what its bits name)."""
    tree, parts = meta.tree, []
    for prefix, bits in zip(tree.prefix, tree.bits):
        parts.append(torch.cat([bits.new_ones((bits.shape[0], prefix)), bits], 1).view(-1))
    return torch.cat(parts)


class FlashInferAttention:
    def __init__(self, device: torch.device, sliding_window: int | None, dtype: torch.dtype = torch.bfloat16) -> None:
        import flashinfer

        self.sliding_window = sliding_window
        self.dtype = dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")

    def plan(self, meta: BatchMetadata, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool = True
             ) -> FlashInferStep:
        return FlashInferStep(self, meta, num_heads, num_kv_heads, head_dim, causal)
