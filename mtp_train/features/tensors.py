"""What one shard stores of a scored batch, and how its hidden states read back.

``hidden`` is kept in bf16, or in FP8 (``precompute.hidden_dtype: fp8``): e4m3 values with one float32 scale per
token and layer (``hidden_scale [T, L]``), the row's largest magnitude over 448 (e4m3's largest finite value), so
that every row uses e4m3's whole range. A row reads back as ``value * scale``. Precompute writes these tensors to
disk; online training (``precompute.mode: online``) builds the same bytes in memory.
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


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [T, L, H]`` as e4m3 values ``[T, L, H]`` and float32 scales ``[T, L]``: each row divided by its
    largest magnitude over 448 (a row of zeros by 1)."""
    # one float32 temporary of the input's size, not four
    scale = torch.linalg.vector_norm(hidden, ord=float("inf"), dim=-1, dtype=torch.float32) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return hidden.float().div(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., H]`` from e4m3 ``values [..., H]`` and ``scale [...]``."""
    return values.float() * scale.float().unsqueeze(-1)


def dequantize_fp8_numpy(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``dequantize_fp8`` with numpy only (e4m3 bits as ``uint8 [..., H]``, ``scale [...]`` float32): the same
    float32 bits, since e4m3 widens exactly and the product is one IEEE multiply either way."""
    out = FP8_VALUES[values]
    out *= scale[..., None]
    return out


def stored_hidden(hidden: torch.Tensor, hidden_dtype: str) -> dict[str, torch.Tensor]:
    """``hidden [T, L, H]`` as a shard stores it: ``{"hidden"}`` in bf16, or ``{"hidden", "hidden_scale"}`` in FP8
    (``hidden_dtype`` is the manifest's name)."""
    if hidden_dtype == HIDDEN_DTYPES["fp8"]:
        values, scale = quantize_fp8(hidden)
        return {"hidden": values.cpu().contiguous(), "hidden_scale": scale.cpu().contiguous()}
    return {"hidden": hidden.to(torch.bfloat16).cpu().contiguous()}


def read_back(hidden: torch.Tensor, hidden_dtype: str) -> torch.Tensor:
    """float32 ``hidden [T, L, H]`` after a round trip through the features' storage (what training reads)."""
    stored = stored_hidden(hidden, hidden_dtype)
    if "hidden_scale" in stored:
        return dequantize_fp8(stored["hidden"], stored["hidden_scale"]).to(hidden.device)
    return stored["hidden"].float().to(hidden.device)


def shard_tensors(scored: ScoreOutput, rows: list[tuple[list[int], list[int]]], topk: int, hidden_dtype: str
                  ) -> dict[str, torch.Tensor]:
    """A shard's tensors (``shared/DESIGN.md``'s table, plus ``logsumexp``, ``tail_logprob`` and, in FP8,
    ``hidden_scale``) for the scored ``rows`` (token ids and loss mask of each sequence)."""
    tensors = {
        "input_ids": torch.tensor([t for ids, _ in rows for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for _, mask in rows for m in mask], dtype=torch.uint8),
        "cu_seqlens": scored.cu_seqlens.to(torch.int64),
        **stored_hidden(scored.hidden, hidden_dtype),
        "logsumexp": scored.logsumexp.float().cpu().contiguous(),
    }
    if topk:
        tensors["topk_logprobs"] = scored.topk_logprobs.to(torch.bfloat16).cpu().contiguous()
        tensors["topk_ids"] = scored.topk_ids.to(torch.int32).cpu().contiguous()
        tensors["tail_logprob"] = scored.tail_logprob.float().cpu().contiguous()
    return tensors
