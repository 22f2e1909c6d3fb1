"""The small-batch weight layout on CPU: which of the target's matmuls run faster from a copy at 1 to 8 rows.

A decode step multiplies each weight by a handful of rows (one per sequence, k + 1 in a verify), so its cost
should be the weight's read. CPU BLAS's small-M kernels instead cost per row (on this project's 2-core machine two
rows cost 1.5–2.1× one, ``bench/small_m_matmul.py``), and their speed depends on the weight's layout, by shape. So
``tune`` measures, once per process, for each distinct weight shape and the row counts ``MEASURED_ROWS``, the stored
layout (``F.linear``) against one copy over every weight of that shape (so that the times are of memory reads,
not of cache hits), and gives the shape's ``Linear`` modules that copy for the row counts where it is faster by
``MARGIN``. The copy is the packed weight of ``runtime/small_rows.py``'s kernel, which reads the weight once for
all rows, where that kernel builds (in bfloat16, half the bytes, where every value of the weight is one: a
checkpoint stored in bf16); otherwise a transposed ``[in, out]`` copy, which BLAS reads faster for some shapes. It
costs the copy's memory, on CPU only, and changes products only by rounding (the parity tests run with it).

With the kernel, ``tune`` also gives each decoder layer the kernel implements its weights in the form
``decode_layer.cpp`` takes (``layer_weights``): a CPU decode or verify step of up to ``MAX_ROWS`` rows then runs
each such layer in one call instead of about 40 ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.models.parts import FeedForward, Linear, RMSNorm
from mtp_train.models.transformer import Attention, DecoderLayer
from mtp_train.runtime import small_rows

MAX_ROWS = small_rows.MAX_ROWS
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, MAX_ROWS)  # row counts timed; one between two takes the larger's
MARGIN = 1.15  # the copy must be this much faster to be worth its memory
REPEATS = 3
_MEASURED: dict[tuple[tuple[int, int], int, int, str], list[int]] = {}
Product = Callable[[torch.Tensor], torch.Tensor]


def _time(fn, repeats: int = REPEATS) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class PackedWeight:
    """A weight packed for the small-row kernel (in bfloat16 where ``bf16`` and its values all are bfloat16), called
    as its product ``x [rows, in] -> [rows, out]``."""

    def __init__(self, weight: torch.Tensor, bf16: bool = True) -> None:
        self.packed = small_rows.pack(weight, bf16=bf16 and small_rows.exactly_bf16(weight))
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return small_rows.linear(x, self.packed, self.out_features)


def _transposed(weight: torch.Tensor) -> Product:
    w_t = weight.t().contiguous()
    return lambda x: x @ w_t


def copy_kind() -> str:
    """``packed`` where the small-row kernel builds on this machine, else ``transposed``."""
    return "packed" if small_rows.kernel() is not None else "transposed"


def tune(model: nn.Module, kind: str | None = None, bf16: bool = True) -> dict[tuple[int, int], list[int]]:
    """Give ``model``'s float32 CPU ``Linear`` modules a copy of their weight (``kind``: ``packed`` or
    ``transposed``, by default ``copy_kind()``) for the row counts where it pays; returns ``(out, in)`` shape ->
    those row counts (for logs and benchmarks). ``bf16=False`` packs every weight in float32 (benchmarks)."""
    kind = kind or copy_kind()
    make = (lambda w: PackedWeight(w, bf16)) if kind == "packed" else _transposed
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    chosen: dict[tuple[int, int], list[int]] = {}
    with torch.no_grad():
        for shape, modules in by_shape.items():
            products = None  # the copies, made only to be measured or kept
            halved = kind == "packed" and bf16 and all(small_rows.exactly_bf16(m.weight) for m in modules)
            key = (shape, len(modules), torch.get_num_threads(), kind + "-bf16" * halved)
            if key not in _MEASURED:  # once per process for a shape, count, thread count and kind
                products = [make(m.weight) for m in modules]
                weights, faster = [m.weight for m in modules], set()
                for n in MEASURED_ROWS:
                    x = torch.randn(n, shape[1])
                    stored = _time(lambda: [F.linear(x, w) for w in weights])
                    copied = _time(lambda: [product(x) for product in products])
                    if stored > MARGIN * copied:
                        faster.add(n)
                _MEASURED[key] = [n for n in range(1, MAX_ROWS + 1)
                                  if min(m for m in MEASURED_ROWS if m >= n) in faster]
            if rows := _MEASURED[key]:
                for module, product in zip(modules, products or [make(m.weight) for m in modules]):
                    module.small_rows = dict.fromkeys(rows, product)
                chosen[shape] = rows
        if kind == "packed":
            for layer in model.modules():
                if isinstance(layer, DecoderLayer) and (weights := layer_weights(layer, bf16)) is not None:
                    layer.decode_weights = weights
    return chosen


def layer_weights(layer: DecoderLayer, bf16: bool = True) -> small_rows.LayerWeights | None:
    """``layer``'s weights as ``decode_layer.cpp`` runs the whole layer in one call (its projections packed), or None
    for a layer that kernel does not implement: latent attention or experts (DeepSeek), biases past the q/k/v
    projection, tensor parallelism, or weights not float32 on the CPU. An EAGLE layer, which has no attention norm
    (``nn.Identity``), runs without it; an EAGLE-3 layer, whose q/k/v read ``2H``, with its input given
    (``Eagle3Head.run``); Gemma's offset norms with the offset added to their weights."""
    attention, mlp = layer.attention, layer.feed_forward
    if not (isinstance(attention, Attention) and isinstance(mlp, FeedForward)):
        return None
    first = None if isinstance(layer.attention_norm, nn.Identity) else layer.attention_norm  # EAGLE's: none
    norms = [n for n in (first, layer.ffn_norm, layer.post_attention_norm, layer.post_ffn_norm) if n is not None]
    head_norms = [n for n in (attention.q_norm, attention.k_norm) if n is not None]
    linears = (attention.wqkv, attention.wo, mlp.w_gate_up, mlp.w_down)
    hidden = attention.wo.out_features
    if (attention.wo_bias is not None or mlp.w_down_bias is not None
            or mlp.w_gate_up.bias is not None or attention.tp.size > 1 or mlp.tp.size > 1
            or not all(isinstance(n, RMSNorm) and n.weight.numel() == hidden for n in norms)
            or not all(isinstance(n, RMSNorm) and n.weight.numel() == attention.head_dim for n in head_norms)
            or len({n.eps for n in norms + head_norms}) != 1 or attention.wqkv.in_features not in (hidden, 2 * hidden)
            or any(t.device.type != "cpu" or t.dtype != torch.float32
                   for t in (*(m.weight for m in linears), *(n.weight for n in norms + head_norms)))):
        return None

    def packed(linear: Linear) -> torch.Tensor:  # the copy ``tune`` keeps for its products where it keeps one
        kept = next((p for p in linear.small_rows.values() if isinstance(p, PackedWeight)), None)
        return (kept or PackedWeight(linear.weight, bf16)).packed

    def weight(norm: RMSNorm | None) -> torch.Tensor | None:  # (1 + w) for Gemma's, in float32 as its forward
        return None if norm is None else (norm.weight.detach() + norm.offset if norm.offset else norm.weight.detach())

    return small_rows.LayerWeights(
        weight(first), packed(attention.wqkv),
        None if attention.wqkv.bias is None else attention.wqkv.bias.detach(), packed(attention.wo),
        weight(layer.ffn_norm), packed(mlp.w_gate_up), packed(mlp.w_down), layer.ffn_norm.eps,
        attention.n_heads, attention.n_kv_heads, attention.head_dim**-0.5, weight(attention.q_norm),
        weight(attention.k_norm), weight(layer.post_attention_norm), weight(layer.post_ffn_norm), mlp.gelu,
        attention.window or 0)
