"""Sliding-window attention over paged KV (the torch backend's): each query reads the keys of its window only.

A query at position p sees the keys at positions above ``p - window`` (and, causal, at or below its own slot; not
causal, every key of its sequence: a DFlash block; in a tree, of the keys from ``TreeMask.prefix`` on, those its
bits name). The keys are gathered token slot by token slot from the pages, a chunk of queries at a time, from the
first position any query of the chunk sees: a decode step reads ``window`` keys whatever the context, and a long
prefill never makes a score matrix longer than a chunk by its keys. Pages wholly below every later query's window
may have been given back (``Drafter.release``): no key is read from them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtp_train.runtime.batch import BatchMetadata

QUERY_CHUNK = 512  # queries of one sequence per SDPA call

Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # slots [N] -> keys, values [N, Hkv, D|Dv]


def _slots(meta: BatchMetadata, b: int, lo: int, hi: int) -> torch.Tensor:
    """Token slots ``[hi - lo]`` of sequence b's positions ``lo..hi-1`` in the cache."""
    size, first = meta.page_size, int(meta.host_page_indptr[b])
    j = torch.arange(lo, hi, device=meta.tokens.device)
    return meta.page_indices.long()[first + j // size] * size + j % size


def windowed_attention(q: torch.Tensor, meta: BatchMetadata, window: int, causal: bool, gather: Gather,
                       scale: float | None = None) -> torch.Tensor:
    """``q [T, Hq, D]`` over the keys and values ``gather`` reads from the cache (this step's already written) ->
    ``[T, Hq, Dv]``; see the module docstring for what each query sees."""
    bounds, kv_lens = meta.host_qo_indptr.tolist(), meta.host_kv_lens.tolist()
    positions = meta.positions.tolist()
    dev = q.device
    out: torch.Tensor | None = None
    for b, kv_len in enumerate(kv_lens):
        s, e = bounds[b], bounds[b + 1]
        tree = None if meta.tree is None else (meta.tree.prefix[b], meta.tree.bits[b])
        for c0 in range(s, e, QUERY_CHUNK):
            c1 = min(e, c0 + QUERY_CHUNK)
            pos = positions[c0:c1]
            lo = max(0, min(pos) - window + 1)
            hi = kv_len if (not causal or tree is not None) else kv_len - (e - c1)  # (causal: up to the last query)
            k, v = gather(_slots(meta, b, lo, hi))
            key_pos = torch.arange(lo, hi, device=dev)
            q_pos = torch.tensor(pos, device=dev)[:, None]
            seen = key_pos[None, :] > q_pos - window
            if tree is not None:
                prefix, bits = tree
                seen &= key_pos[None, :] < prefix
                width = min(hi, prefix + bits.shape[1]) - prefix
                if width > 0:
                    seen[:, prefix - lo : prefix - lo + width] = bits[c0 - s : c1 - s, :width]
            elif causal:
                slot = kv_len - (e - s) + torch.arange(c0 - s, c1 - s, device=dev)  # each query's own slot
                seen &= key_pos[None, :] <= slot[:, None]
            mask = torch.zeros(seen.shape, dtype=q.dtype, device=dev).masked_fill_(~seen, float("-inf"))
            gqa = k.shape[1] != q.shape[1]
            part = F.scaled_dot_product_attention(
                q[None, c0:c1].transpose(1, 2), k[None].transpose(1, 2).to(q.dtype), v[None].transpose(1, 2).to(q.dtype),
                attn_mask=mask[None, None], enable_gqa=gqa, scale=scale)[0].transpose(0, 1)
            if out is None:
                out = q.new_empty((q.shape[0], q.shape[1], part.shape[-1]))
            out[c0:c1] = part
    assert out is not None, "a step has at least one query"
    return out
