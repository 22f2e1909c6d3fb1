"""Attention for head training over packed documents, no KV cache.

``DocumentCausalAttention`` runs SDPA per document, causal: a GPU's flash kernel takes it in bf16. What no fused
kernel takes goes through ``range_attention`` instead: MLA's absorbed form (a 576-wide key head), eagle3's
training-time test (the step-0 keys causally, then one key of each later step at the query's own row) and dflash's
blocks (the context before each anchor, then the block's own keys). Each query sees a range of context rows and the
extra keys of its group; the scores are made a chunk of queries at a time and made again in backward, so that what
autograd keeps is q, k and v, as a flash kernel keeps, and the scores never exist for more than one chunk.
"""

from __future__ import annotations

from bisect import bisect_right
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Bytes of one chunk's float32 scores [rows, heads, keys]. A chunk's forward and backward hold a few tensors of that
# size at once (scores, probabilities, their gradients): ATTENTION_PEAK_BYTES bounds them for the memory plan.
SCORE_CHUNK_BYTES = 256 * 2**20
ATTENTION_PEAK_BYTES = 5 * SCORE_CHUNK_BYTES


@dataclass(frozen=True)
class KeyRanges:
    """Which keys query row r sees: context rows ``lo[r] <= m < hi[r]`` and the extra keys of the rows of its group
    (rows ``g * group .. g * group + group - 1`` for ``g = r // group``): all of them, or with ``own`` those of the
    group's first ``own[r]`` rows only. ``lo`` and ``hi`` are host lists, ``hi`` non-decreasing in r (packed
    documents in order) and ``lo`` nearly so (a window's blocks step back by less than a block), and every row sees
    at least one key."""

    lo: list[int]
    hi: list[int]
    group: int = 1
    own: torch.Tensor | None = None  # [R] long, on the queries' device: group rows whose keys row r sees

    def chunks(self, heads: int, extra: int) -> list[tuple[int, int]]:
        """Row ranges ``[r0, r1)``, whole groups each, whose float32 scores (``rows x heads x`` the keys from the
        first row's ``lo`` to the last row's ``hi``, plus ``extra`` per row) fit ``SCORE_CHUNK_BYTES``: a group at
        least. Documents (runs of rows with one ``lo``) are packed whole into a chunk while its scores stay within
        twice those of its documents alone: a chunk over many packed documents would score every row against every
        document's keys, most of them masked."""
        rows, out = len(self.lo), []
        starts = [r for r in range(0, rows, self.group) if r == 0 or self.lo[r] != self.lo[r - 1]]
        packed: tuple[int, int, int] | None = None  # (r0, r1, scores of its documents alone)
        for d0, d1 in zip(starts, starts[1:] + [rows]):
            alone = self._cost(d0, d1, heads, extra)
            if packed and self._cost(packed[0], d1, heads, extra) <= min(SCORE_CHUNK_BYTES, 2 * (packed[2] + alone)):
                packed = (packed[0], d1, packed[2] + alone)
                continue
            if packed:
                out.append(packed[:2])
            packed = None
            if alone <= SCORE_CHUNK_BYTES:
                packed = (d0, d1, alone)
            else:
                out += self._split(d0, d1, heads, extra)
        return out + ([packed[:2]] if packed else [])

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """The context rows that rows ``[r0, r1)`` see, from the least ``lo`` to the last ``hi``."""
        return min(self.lo[r0:r1]), self.hi[r1 - 1]

    def _cost(self, r0: int, r1: int, heads: int, extra: int) -> int:
        return (r1 - r0) * heads * (self.hi[r1 - 1] - self.lo[r0] + extra) * 4

    def _split(self, start: int, end: int, heads: int, extra: int) -> list[tuple[int, int]]:
        """Rows ``[start, end)`` of one document in chunks within ``SCORE_CHUNK_BYTES``, the most groups each."""
        out, r0 = [], start
        while r0 < end:
            # the cost only grows with the rows (hi is non-decreasing): the most groups within budget, by bisection
            most = (end - r0) // self.group
            groups = max(1, bisect_right(range(1, most + 1), SCORE_CHUNK_BYTES,
                                         key=lambda g: self._cost(r0, r0 + g * self.group, heads, extra)))
            out.append((r0, r0 + groups * self.group))
            r0 += groups * self.group
        return out


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor], lo: torch.Tensor,
                  hi: torch.Tensor, group: int, scale: float, own: torch.Tensor | None) -> torch.Tensor:
    """One chunk, in float32: ``q [c, Hq, D]``, the chunk's context ``k [n, Hkv, D]``, ``v [n, Hkv, Dv]``, its rows'
    ranges ``lo, hi [c]`` (relative to k), extra keys then values ``[c, Hkv, D]`` / ``[c, Hkv, Dv]`` (x keys, then x
    values), the group rows whose extra keys each row sees ``own [c]`` (None: all) -> ``[c, Hq, Dv]``. The query heads of a key head are one view (``[c, Hkv, rep, D]``): no key is copied
    per query head."""
    c, hq, d = q.shape
    hkv, n, x = k.shape[1], k.shape[0], len(extras) // 2
    qg = q.float().view(c, hkv, hq // hkv, d) * scale
    scores = torch.einsum("cgrd,ngd->cgrn", qg, k.float())
    cols = torch.arange(n, device=q.device)
    scores = scores.masked_fill(((cols < lo[:, None]) | (cols >= hi[:, None]))[:, None, None], float("-inf"))
    if x:
        blocks = c // group  # [c, x, Hkv, D] -> per group: its rows' x keys each, [blocks, group * x, Hkv, D]
        ek = torch.stack(extras[:x], 1).float().reshape(blocks, group * x, hkv, d)
        ev = torch.stack(extras[x:], 1).float().reshape(blocks, group * x, hkv, -1)
        mine = torch.einsum("bigrd,bjgd->bigrj", qg.view(blocks, group, *qg.shape[1:]), ek).reshape(c, hkv, -1, group * x)
        if own is not None:  # key j of the group is row j // x's
            hidden = torch.arange(group * x, device=q.device) // x >= own[:, None]
            mine = mine.masked_fill(hidden[:, None, None], float("-inf"))
        scores = torch.cat([scores, mine], -1)
    p = torch.softmax(scores, -1)
    out = torch.einsum("cgrn,ngd->cgrd", p[..., :n], v.float())
    if x:
        p_own = p[..., n:].reshape(blocks, group, hkv, hq // hkv, group * x)
        out = out + torch.einsum("bigrj,bjgd->bigrd", p_own, ev).reshape(out.shape)
    return out.reshape(c, hq, -1)


def _rows(own: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
    return None if own is None else own[r0:r1]


class _RangeAttention(torch.autograd.Function):
    """``range_attention``'s autograd: saves its inputs only, and makes each chunk again in backward."""

    @staticmethod
    def forward(ctx, ranges: KeyRanges, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *extras: torch.Tensor) -> torch.Tensor:
        ctx.ranges, ctx.scale = ranges, scale
        ctx.save_for_backward(q, k, v, *extras)
        ctx.chunks = ranges.chunks(q.shape[1], ranges.group * len(extras) // 2)
        lo, hi = (torch.tensor(t, device=q.device) for t in (ranges.lo, ranges.hi))
        ctx.bounds = lo, hi
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        with _no_autocast(q.device):
            for r0, r1 in ctx.chunks:
                k0, k1 = ranges.span(r0, r1)
                out[r0:r1] = _attend_chunk(q[r0:r1], k[k0:k1], v[k0:k1], [e[r0:r1] for e in extras], lo[r0:r1] - k0,
                                           hi[r0:r1] - k0, ranges.group, scale, _rows(ranges.own, r0, r1))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, *extras = ctx.saved_tensors
        ranges, (lo, hi) = ctx.ranges, ctx.bounds
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v, *extras)]
        with _no_autocast(q.device):
            for r0, r1 in ctx.chunks:
                k0, k1 = ranges.span(r0, r1)
                parts = [q[r0:r1], k[k0:k1], v[k0:k1], *(e[r0:r1] for e in extras)]
                leaves = [t.detach().float().requires_grad_() for t in parts]
                with torch.enable_grad():
                    out = _attend_chunk(leaves[0], leaves[1], leaves[2], leaves[3:], lo[r0:r1] - k0, hi[r0:r1] - k0,
                                        ranges.group, ctx.scale, _rows(ranges.own, r0, r1))
                got = torch.autograd.grad(out, leaves, grad[r0:r1].float())
                for whole, rows, g in zip(grads, [(r0, r1), (k0, k1), (k0, k1)] + [(r0, r1)] * len(extras), got):
                    whole[rows[0] : rows[1]] += g
        return (None, None, *(g.to(t.dtype) for g, t in zip(grads, (q, k, v, *extras))))


def range_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: KeyRanges,
                    extras: list[tuple[torch.Tensor, torch.Tensor]] = (), scale: float | None = None) -> torch.Tensor:
    """``q [R, Hq, D]`` over context keys ``k [N, Hkv, D]`` and values ``v [N, Hkv, Dv]`` as ``ranges`` says, and over
    the extra keys and values ``extras`` (each ``[R, Hkv, D]``, ``[R, Hkv, Dv]``) of each row's group -> ``[R, Hq, Dv]``
    in q's dtype. One softmax over both, in float32 (the scale ``D**-0.5`` unless given), as SDPA's math kernel with
    the equivalent mask computes it; grouped-query attention when ``Hkv < Hq``."""
    flat = [e[0] for e in extras] + [e[1] for e in extras]
    return _RangeAttention.apply(ranges, q.shape[-1] ** -0.5 if scale is None else scale, q, k, v, *flat)


def causal_ranges(cu_seqlens: list[int], window: int = 0, shift: int = 0) -> KeyRanges:
    """Each row sees its document's rows up to itself: ``lo`` the document's start, ``hi`` the row + 1. With a
    ``window`` (``head.window``; 0: none), only the rows at positions above the query's own minus the window, the
    query standing ``shift`` positions past its row (training-time test's step ``shift``)."""
    lo = [s if not window else max(s, r + shift - window + 1)
          for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]) for r in range(s, e)]
    return KeyRanges(lo, list(range(1, cu_seqlens[-1] + 1)))


class DocumentCausalAttention:
    """A step plan for ``models.transformer.Attention`` over packed documents.

    ``cu_seqlens [D+1]`` are document offsets into the packed tokens; query i attends to keys
    j <= i of its own document only, and with a ``window`` (``head.window``) to the ``window`` last of them only
    (``range_attention``, a chunk of rows at a time: no dense mask).
    """

    def __init__(self, cu_seqlens: list[int], window: int = 0) -> None:
        self.cu_seqlens, self.window = cu_seqlens, window
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``[T, Hq, D]``."""
        if self.window:
            return range_attention(q, k, v, causal_ranges(self.cu_seqlens, self.window))
        gqa = k.shape[1] != q.shape[1]
        parts = [
            F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2), v[None, s:e].transpose(1, 2),
                is_causal=True, enable_gqa=gqa,
            )[0].transpose(0, 1)
            for s, e in self.bounds
        ]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor, cache, v_dim: int, scale: float) -> torch.Tensor:
        """MLA, absorbed: ``q [T, H, D]`` against ``latent [T, 1, D]`` (its first ``v_dim`` channels the value)
        -> ``[T, H, v_dim]``, by ``range_attention``: no fused kernel takes a 576-wide key head."""
        return range_attention(q, latent, latent[..., :v_dim], causal_ranges(self.cu_seqlens, self.window), scale=scale)
