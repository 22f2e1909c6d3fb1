"""The target's frozen embedding, final norm and lm_head, read selectively from its checkpoint.

Only these tensors are read (through the safetensors index when the checkpoint is sharded), so
memory does not grow with the target's depth. They are buffers, never parameters: no optimizer
or gradient ever touches them.

Under bf16 or fp16 autocast the lm_head's matmul runs on a half copy of the fp32 weight, made once and kept
(``half_lm_head``): autocast caches its casts of parameters only, so it would cast this buffer again for every
chunk of the loss and again when backward recomputes the chunk (a ``[vocab, H]`` temporary each time, 2 GiB at
70B). The copy holds exactly the values autocast's cast would make, so the logits are the same bits.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.models.checkpoint import read_tensors, weight_locations
from mtp_train.models.config import ModelConfig
from mtp_train.models.parts import offset_rms_norm, scale_embeddings

EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


class FrozenTarget(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("embed_weight", embed)  # [vocab, H]
        self.register_buffer("norm_weight", norm)  # [H]
        self.register_buffer("lm_head_weight", lm_head)  # [vocab, H]
        self._half: dict[torch.dtype, torch.Tensor] = {}  # half_lm_head's copies, by dtype

    def _apply(self, fn, recurse: bool = True):
        self._half = {}  # .to(), .cuda(), .half() ...: the copies are of the weight as it was
        return super()._apply(fn, recurse)

    @classmethod
    def load(cls, root: Path, dtype: torch.dtype = torch.float32) -> FrozenTarget:
        ckpt = find_checkpoint(root)
        cfg = ModelConfig.from_hf(ckpt.config, str(root / "config.json"))
        tied = cfg.tie_word_embeddings and LM_HEAD not in weight_locations(ckpt)
        t = read_tensors(root, [EMBED, NORM] + ([] if tied else [LM_HEAD]), dtype)
        return cls(cfg, t[EMBED], t[NORM], t[EMBED] if tied else t[LM_HEAD])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, H]``, as the target's first layer reads them (Gemma's times √hidden, the runtime's
        ``Transformer.embed``)."""
        return scale_embeddings(F.embedding(tokens, self.embed_weight), self.cfg.embed_scale)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm (Gemma's scaling by ``1 + weight``): pre-norm ``[T, H]`` -> post-norm
        ``[T, H]``."""
        if self.cfg.norm_offset:
            return offset_rms_norm(hidden, self.norm_weight, self.cfg.rms_norm_eps, self.cfg.norm_offset)
        return F.rms_norm(hidden, self.norm_weight.shape, self.norm_weight, self.cfg.rms_norm_eps)

    def half_lm_head(self, dtype: torch.dtype) -> torch.Tensor:
        """The lm_head in ``dtype`` (bf16 or fp16) ``[vocab, H]``: made from the fp32 weight on first use, then kept."""
        if self._half.get(dtype) is None:
            self._half[dtype] = self.lm_head_weight.detach().to(dtype)
        return self._half[dtype]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` lm_head inputs -> ``[T, vocab]`` float32 logits (under half autocast, from ``half_lm_head``)."""
        weight, kind = self.lm_head_weight, x.device.type
        if weight.dtype == torch.float32 and kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            if dtype in (torch.bfloat16, torch.float16):
                weight = self.half_lm_head(dtype)
        return F.linear(x, weight).float()

