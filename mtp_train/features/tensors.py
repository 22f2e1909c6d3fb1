"""What one shard stores of a scored batch, and how its hidden states read back.

``hidden`` is kept in bf16, or in FP8 (``precompute.hidden_dtype: fp8``): e4m3 values with one float32 scale per
token and layer (``hidden_scale [T, L]``), the row's largest magnitude over 448 (e4m3's largest finite value), so
that every row uses e4m3's whole range. A row reads back as ``value * scale``. Precompute writes these tensors to
disk; online training (``precompute.mode: online``) builds the same bytes in memory. Both hand ``Engine.score`` the
conversion (``hidden_storage``), which it applies to each batch where the batch was computed, before the copy to
the host: the host never holds a shard's hidden states in more bytes than the shard stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from mtp_train.runtime.engine import ScoreOutput

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# precompute.hidden_dtype -> the manifest's hidden_dtype (torch's name of the stored dtype)
HIDDEN_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
# every e4m3 bit pattern as the float32 it stands for (the reader's conversion, with numpy only)
FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float().numpy()


QUANTIZE_ROWS = 2048  # tokens quantized at once: the float32 temporaries stay this size, not a scoring batch's


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [T, L, H]`` as e4m3 values ``[T, L, H]`` and float32 scales ``[T, L]``: each row divided by its
    largest magnitude over 448 (a row of zeros by 1). ``QUANTIZE_ROWS`` tokens at a time, each row the same bits as
    at once: on the device, a 32,768-token batch at hidden 8,192 would otherwise take two float32 copies of 1 GiB."""
    values = torch.empty(hidden.shape, dtype=FP8, device=hidden.device)
    scale = torch.empty(hidden.shape[:-1], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        part = hidden[rows]
        s = torch.linalg.vector_norm(part, ord=float("inf"), dim=-1, dtype=torch.float32) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        scale[rows] = s
        values[rows] = part.float().div(s.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., H]`` from e4m3 ``values [..., H]`` and ``scale [...]``."""
    return values.float() * scale.float().unsqueeze(-1)


def dequantize_fp8_numpy(values: np.ndarray, scale: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``dequantize_fp8`` with numpy only, on the calling thread: float32 ``[..., H]`` (into ``out`` when given)
    from e4m3 bits ``values`` (``uint8 [..., H]``, any strides) and float32 ``scale [...]``, the same float32 bits.

    Each byte is moved into place as a float32's bits, ``sign << 31 | (exponent, mantissa) << 20``: that float is
    the e4m3 value times 2^-120 exactly (e4m3's subnormals become float32 subnormals), and one multiply by
    ``scale * 2^120`` (exact: a power of two) rounds ``value * scale`` once, as the table does. A cast, two integer
    passes and a multiply over blocks that stay in the cache run faster than bf16's widening (a shift of twice the
    bytes), and several times faster than a gather from the 256-entry table.
    The table serves what this cannot: a thread whose float unit treats subnormals as zero, rows whose
    ``scale * 2^120`` overflows, and rows holding e4m3's NaN (0x7F, 0xFF), which are written again from it."""
    scale = np.asarray(scale, np.float32)
    out = np.empty(values.shape, np.float32) if out is None else out
    if not values.size:
        return out
    h = values.shape[-1]
    src, dst, rows = values.reshape(-1, h), out.reshape(-1, h), scale.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        if _subnormals_are_zero():
            np.multiply(FP8_VALUES[src], rows[:, None], out=dst)
            return out
        scaled = rows * np.float32(2.0**120)
        step = max(1, _BLOCK // h)
        bits, table = dst.view(np.uint32), []
        scratch = np.empty((min(step, len(src)), h), np.uint8)
        for a in range(0, len(src), step):
            b, k = bits[a : a + step], min(step, len(src) - a)
            # the byte sign-extended (read as int8) then shifted: its sign lands on bit 31 and on bits 27..30 ...
            np.copyto(b, src[a : a + step].view(np.int8), casting="unsafe")  # a plain cast: no buffered ufunc
            b <<= 20
            b &= np.uint32(_E4M3_IN_FLOAT32)  # ... which are cleared
            np.multiply(dst[a : a + step], scaled[a : a + step, None], out=dst[a : a + step])
            if np.bitwise_or(src[a : a + step], 0x80, out=scratch[:k]).max() == 0xFF:  # a NaN (0x7F, 0xFF)
                table.append(np.arange(a, a + k))
        table += [np.flatnonzero(~np.isfinite(scaled) & np.isfinite(rows))]  # where scale * 2^120 overflowed
        if redo := np.unique(np.concatenate(table)).tolist():
            dst[redo] = FP8_VALUES[src[redo]] * rows[redo, None]
    return out


_BLOCK = 1 << 17  # elements per block of dequantize_fp8_numpy: 512 KiB of float32, about a core's L2
_E4M3_IN_FLOAT32 = 0x87FFFFFF  # bit 31 (the sign) and bits 0..26: what is left of the sign's copies is cleared


def _subnormals_are_zero() -> bool:
    """Whether this thread's float unit reads subnormal float32 inputs as zero (DAZ): e4m3's subnormals then need
    the table."""
    return bool(np.float32(2.0**-140) * np.float32(2.0**20) == 0)


def hidden_storage(hidden_dtype: str):
    """What ``Engine.score`` makes of each batch's hidden states ``[t, L, H]`` where they were computed, for a shard
    of ``hidden_dtype`` (the manifest's name): e4m3 values and their scales ``[t, L]``, or bf16 and None."""
    if hidden_dtype == HIDDEN_DTYPES["fp8"]:
        return lambda hidden: quantize_fp8(hidden)
    return lambda hidden: (hidden.to(torch.bfloat16), None)


def stored_hidden(hidden: torch.Tensor, hidden_dtype: str) -> dict[str, torch.Tensor]:
    """``hidden [T, L, H]`` as a shard stores it: ``{"hidden"}`` in bf16, or ``{"hidden", "hidden_scale"}`` in FP8
    (``hidden_dtype`` is the manifest's name)."""
    values, scale = hidden_storage(hidden_dtype)(hidden)
    stored = {"hidden": values.cpu().contiguous()}
    return stored if scale is None else {**stored, "hidden_scale": scale.cpu().contiguous()}


def read_back(hidden: torch.Tensor, hidden_dtype: str) -> torch.Tensor:
    """float32 ``hidden [T, L, H]`` after a round trip through the features' storage (what training reads)."""
    stored = stored_hidden(hidden, hidden_dtype)
    if "hidden_scale" in stored:
        return dequantize_fp8(stored["hidden"], stored["hidden_scale"]).to(hidden.device)
    return stored["hidden"].float().to(hidden.device)


def token_tensors(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """``input_ids [T]`` int32 and ``loss_mask [T]`` uint8 of ``rows`` (token ids and loss mask of each sequence)."""
    return {"input_ids": torch.tensor([t for ids, _ in rows for t in ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for _, mask in rows for m in mask], dtype=torch.uint8)}


def scored_tensors(scored: ScoreOutput, topk: int, hidden_dtype: str) -> dict[str, torch.Tensor]:
    """What a shard stores of ``scored`` (``hidden`` and, in FP8, ``hidden_scale``; ``logsumexp``; with a top-K its
    log-probs, ids and ``tail_logprob``). Hidden states that ``score`` already stored (``hidden_storage``) are kept
    as they are; others are converted here."""
    stored_dtype = FP8 if hidden_dtype == HIDDEN_DTYPES["fp8"] else torch.bfloat16
    if scored.hidden.dtype == stored_dtype:
        assert (scored.hidden_scale is not None) == (stored_dtype == FP8), "e4m3 values come with their scales"
        hidden = {"hidden": scored.hidden.cpu().contiguous()}
        if scored.hidden_scale is not None:
            hidden["hidden_scale"] = scored.hidden_scale.cpu().contiguous()
    else:
        hidden = stored_hidden(scored.hidden, hidden_dtype)
    tensors = {**hidden, "logsumexp": scored.logsumexp.float().cpu().contiguous()}
    if topk:
        tensors["topk_logprobs"] = scored.topk_logprobs.to(torch.bfloat16).cpu().contiguous()
        tensors["topk_ids"] = scored.topk_ids.to(torch.int32).cpu().contiguous()
        tensors["tail_logprob"] = scored.tail_logprob.float().cpu().contiguous()
    return tensors


def shard_tensors(scored: ScoreOutput, rows: list[tuple[list[int], list[int]]], topk: int, hidden_dtype: str
                  ) -> dict[str, torch.Tensor]:
    """A shard's tensors (``shared/DESIGN.md``'s table, plus ``logsumexp``, ``tail_logprob`` and, in FP8,
    ``hidden_scale``) for the scored ``rows`` (token ids and loss mask of each sequence)."""
    tokens = token_tensors(rows)
    return {**tokens, "cu_seqlens": scored.cu_seqlens.to(torch.int64), **scored_tensors(scored, topk, hidden_dtype)}
