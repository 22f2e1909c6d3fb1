"""FlashInfer attention on CUDA: paged prefill/append wrappers (plan once per step, run per layer).

Imported only when the flashinfer backend is selected. Every batch kind (prefill, decode, verify, a DFlash block,
which is not causal, a tree with its custom mask) is an "append" over paged KV. Two wrappers share one float
workspace (their runs follow one another on one stream):

- ``wrapper`` (backend ``auto``: fa3 on Hopper, else fa2) plans causal steps and DFlash's non-causal block;
- ``masked`` (backend ``fa2``) plans a tree's steps: fa3 has no custom-mask kernel, and ``auto`` fixes its choice
  at a wrapper's first plan, so one wrapper cannot serve both.

The plans take the per-sequence arrays from the host (``BatchMetadata.host_*``) and the page indices from the
device. A tree's mask is packed on the device here (``packed_mask``), its sizes computed on the host, and handed to
the planned wrapper (``_set_mask``): given an unpacked mask, flashinfer 0.6.6's ``plan`` packs it with
``segment_packbits``, a CUDA kernel, against an index it builds from the host arrays, and fails.
"""

from __future__ import annotations

import torch

from mtp_train.runtime.batch import BatchMetadata
from mtp_train.runtime.device import to_device
from mtp_train.runtime.reserve import FLASHINFER_FLOAT_WORKSPACE

WORKSPACE_BYTES = FLASHINFER_FLOAT_WORKSPACE


class FlashInferStep:
    def __init__(self, backend: FlashInferAttention, meta: BatchMetadata, num_heads: int, num_kv_heads: int,
                 head_dim: int, causal: bool = True) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.meta = meta
        tree = meta.tree is not None
        self.wrapper = backend.masked if tree else backend.wrapper
        # The indptr arrays from the host (pinned): ``plan`` reads them there, and copying them back from the
        # device would make the host wait for the queue in every step.
        self.wrapper.plan(
            meta.host_qo_indptr,
            meta.host_page_indptr,
            meta.page_indices,
            meta.host_last_page_len,
            num_heads,
            num_kv_heads,
            head_dim,
            meta.page_size,
            causal=causal and not tree,
            # a tree's window is in its mask: FlashInfer's window_left counts from slots, a tree node's from depth
            window_left=-1 if backend.sliding_window is None or tree else backend.sliding_window - 1,
            q_data_type=backend.dtype,
            kv_data_type=backend.dtype,
            seq_lens=meta.host_kv_lens,  # pinned: plan copies the lengths to the GPU without waiting for it
        )
        if tree:
            _set_mask(self.wrapper, *packed_mask(meta, backend.sliding_window))
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


def _set_mask(wrapper, packed: torch.Tensor, byte_indptr: torch.Tensor) -> None:
    """Give a planned fa2 wrapper the step's packed mask and its byte offsets, both already on the device.

    The mask is set after an unmasked plan rather than passed to it: the plan computes nothing from a mask (fa2's
    schedule takes none) but its index, from the host arrays, of the *unpacked* bits, which 0.6.6 keeps even when
    given a packed mask (its kernel reads the index as byte offsets; flashinfer PR #2201, open) and copies to the
    GPU from pageable memory. ``run`` reads ``_custom_mask_buf`` and ``_mask_indptr_buf`` and, with a mask there,
    runs its custom-mask kernel.
    """
    for name in ("_custom_mask_buf", "_mask_indptr_buf"):
        if not hasattr(wrapper, name):
            raise RuntimeError(f"flashinfer's wrapper has no {name}: this runtime's tree masks are written for "
                               "flashinfer-python 0.6.6 (the `gpu` extra)")
    wrapper._custom_mask_buf, wrapper._mask_indptr_buf = packed, byte_indptr


def packed_mask(meta: BatchMetadata, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree step's attention mask as FlashInfer's kernel reads it, built on the device without a host sync.

    Sequence b's mask is ``[q_b, kv_b]`` (query i sees the context before ``prefix[b]``, then what ``bits[b][i]``
    names), flattened row-major and packed 8 bits to a byte, least significant first; each sequence starts at a
    byte of its own. With a ``window`` (a draft's ``head.window``) query i sees only the context above its
    position (``positions``: its depth in the tree, not its slot) minus the window, as the torch backend and
    training do; the tree's own keys lie within it (a window exceeds the tree's depth). Returns the packed mask
    ``[sum ceil(q_b kv_b / 8)]`` uint8 and its byte offsets ``[B+1]`` int32, both on the device. The sizes come
    from the host arrays; the bits never leave the device.
    """
    tree = meta.tree
    assert tree is not None
    dev, b = meta.tokens.device, len(tree.bits)
    q_lens = (meta.host_qo_indptr[1:] - meta.host_qo_indptr[:-1]).long()
    kv_lens = meta.host_kv_lens.long()
    prefix = torch.tensor(tree.prefix, dtype=torch.int64)
    span = kv_lens - prefix  # the columns each sequence's bits cover
    nbits = q_lens * kv_lens
    nbytes = (nbits + 7) // 8
    indptr = torch.zeros(b + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(nbytes, 0)
    host = torch.cat([_exclusive(nbits), indptr[:-1], _exclusive(q_lens * span), kv_lens, prefix, span, nbits, nbytes,
                      meta.host_qo_indptr[:-1].long(), indptr])
    moved = to_device(host, dev)  # one copy of every size
    bit_start, byte_start, bits_start, kv, pre, cols, length, count, first_query = moved[: 9 * b].view(9, b).unbind(0)
    total = int(indptr[-1])
    seq = torch.repeat_interleave(torch.arange(b, device=dev), count, output_size=total)  # [N] each byte's sequence
    first_bit = bit_start[seq] + 8 * (torch.arange(total, device=dev) - byte_start[seq])
    end_bit = bit_start[seq] + length[seq]
    bits = torch.cat([t.reshape(-1) for t in tree.bits])
    packed = torch.zeros(total, dtype=torch.uint8, device=dev)
    for shift in range(8):  # one [N] pass per bit: the working set stays that of the mask itself
        flat = first_bit + shift
        local = flat - bit_start[seq]
        row, col = local // kv[seq], local % kv[seq]
        inside = col >= pre[seq]
        at = (bits_start[seq] + row * cols[seq] + col - pre[seq]).clamp(0, bits.numel() - 1)
        context = ~inside
        if window is not None:  # (a padding bit's row runs past its sequence: clamped, and cut by end_bit)
            query = (first_query[seq] + row).clamp(0, meta.positions.numel() - 1)
            context &= col > meta.positions[query] - window
        on = (flat < end_bit) & (context | (inside & bits[at]))
        packed |= on.to(torch.uint8) << shift
    return packed, moved[9 * b :].to(torch.int32)


def _exclusive(sizes: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> the offsets ``[B]`` at which each of ``sizes`` starts."""
    return torch.cumsum(sizes, 0) - sizes


def load_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, sliding_window: int | None) -> None:
    """Build, or load where they are prebuilt, the kernels this backend plans for ``head_dim`` heads in ``dtype``:
    the paged prefill module ``auto`` picks on ``device`` (fa3 on Hopper: causal steps and DFlash's non-causal
    block; with a sliding window, its variant), fa2's (tree masks, a window among them) and the paged-append
    module. flashinfer 0.6.6 compiles a module with nvcc at its
    first use, into ``~/.cache/flashinfer``, unless its ``data/aot`` folder holds it (``bench/flashinfer_aot.sh``);
    this raises whatever that build raises (no nvcc on the node, a failed compile)."""
    from flashinfer.page import get_page_module
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.utils import determine_attention_backend

    auto = determine_attention_backend(device, 0, False, False, dtype, dtype)
    # (the module's sliding-window flag: fa2 plans trees, whose window is in the mask, with none)
    for backend, window in dict.fromkeys(((auto, sliding_window is not None), ("fa2", False))):
        get_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, window, False, False)
    get_page_module()


class FlashInferAttention:
    def __init__(self, device: torch.device, sliding_window: int | None, dtype: torch.dtype = torch.bfloat16) -> None:
        import flashinfer

        self.sliding_window = sliding_window
        self.dtype = dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        self.masked = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD", backend="fa2")

    def plan(self, meta: BatchMetadata, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool = True
             ) -> FlashInferStep:
        return FlashInferStep(self, meta, num_heads, num_kv_heads, head_dim, causal)
