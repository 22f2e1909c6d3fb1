"""Sliding-window attention over paged KV (the torch backend's): each query reads the keys of its window only.

A query at position p sees the keys at positions above ``p - window`` (and, causal, at or below its own slot; not
causal, every key of its sequence: a DFlash block; in a tree, of the keys from ``TreeMask.prefix`` on, those its
bits name). The keys are gathered token slot by token slot from the pages, a chunk of queries at a time, from the
first position any query of the chunk sees: a decode step reads ``window`` keys whatever the context, and a long
prefill never makes a score matrix longer than a chunk by its keys. Pages wholly below every later query's window
may have been given back (``PageAllocator.release_below``): no key is read from them. The chunks' slots and masks
(``window_plan``) are made once per step and serve every layer (``windowed_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp_train.runtime.batch import BatchMetadata

QUERY_CHUNK = 512  # queries of one sequence per SDPA call

Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # slots [N] -> keys, values [N, Hkv, D|Dv]


@dataclass(frozen=True)
class WindowChunk:
    """Queries ``rows`` (``[c0, c1)`` of the step) of one sequence, the cache ``slots [N]`` of the keys they may see,
    and the additive mask ``[c1 - c0, N]`` (float32: 0 seen, -inf not)."""

    rows: slice
    slots: torch.Tensor
    mask: torch.Tensor


def _slots(meta: BatchMetadata, b: int, lo: int, hi: int) -> torch.Tensor:
    """Token slots ``[hi - lo]`` of sequence b's positions ``lo..hi-1`` in the cache."""
    size, first = meta.page_size, int(meta.host_page_indptr[b])
    j = torch.arange(lo, hi, device=meta.tokens.device)
    return meta.page_indices.long()[first + j // size] * size + j % size


def window_plan(meta: BatchMetadata, window: int, causal: bool) -> list[WindowChunk]:
    """The step's chunks of queries, each with the slots and mask of what its queries see (the module docstring)."""
    bounds, kv_lens = meta.host_qo_indptr.tolist(), meta.host_kv_lens.tolist()
    positions = meta.positions.tolist()
    dev = meta.tokens.device
    chunks = []
    for b, kv_len in enumerate(kv_lens):
        s, e = bounds[b], bounds[b + 1]
        tree = None if meta.tree is None else (meta.tree.prefix[b], meta.tree.bits[b])
        for c0 in range(s, e, QUERY_CHUNK):
            c1 = min(e, c0 + QUERY_CHUNK)
            pos = positions[c0:c1]
            lo = max(0, min(pos) - window + 1)
            hi = kv_len if (not causal or tree is not None) else kv_len - (e - c1)  # (causal: up to the last query)
            key_pos = torch.arange(lo, hi, device=dev)
            seen = key_pos[None, :] > torch.tensor(pos, device=dev)[:, None] - window
            if tree is not None:
                prefix, bits = tree
                seen &= key_pos[None, :] < prefix
                width = min(hi, prefix + bits.shape[1]) - prefix
                if width > 0:
                    seen[:, prefix - lo : prefix - lo + width] = bits[c0 - s : c1 - s, :width]
            elif causal:
                slot = kv_len - (e - s) + torch.arange(c0 - s, c1 - s, device=dev)  # each query's own slot
                seen &= key_pos[None, :] <= slot[:, None]
            mask = torch.zeros(seen.shape, device=dev).masked_fill_(~seen, float("-inf"))
            chunks.append(WindowChunk(slice(c0, c1), _slots(meta, b, lo, hi), mask))
    return chunks


def windowed_attention(q: torch.Tensor, chunks: list[WindowChunk], gather: Gather,
                       scale: float | None = None) -> torch.Tensor:
    """``q [T, Hq, D]`` over the keys and values ``gather`` reads from the cache (this step's already written), as
    ``chunks`` (``window_plan``) say -> ``[T, Hq, Dv]``."""
    out: torch.Tensor | None = None
    for chunk in chunks:
        k, v = gather(chunk.slots)
        part = F.scaled_dot_product_attention(
            q[None, chunk.rows].transpose(1, 2), k[None].transpose(1, 2).to(q.dtype),
            v[None].transpose(1, 2).to(q.dtype), attn_mask=chunk.mask.to(q.dtype)[None, None],
            enable_gqa=k.shape[1] != q.shape[1], scale=scale)[0].transpose(0, 1)
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], part.shape[-1]))
        out[chunk.rows] = part
    assert out is not None, "a step has at least one query"
    return out
