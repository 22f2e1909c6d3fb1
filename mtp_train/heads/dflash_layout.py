"""A ``dflash`` head in the layout vLLM's DFlash loader reads (``DFlashDraftModel``; format note: ``docs/export.md``,
"DFlash in vLLM").

Weights, without a ``model.`` prefix (vLLM adds it): ``fc.weight [H, nH]``, ``hidden_norm.weight``, ``norm.weight``
and ``layers.{i}.*`` in Qwen3's HF names (``self_attn.q_norm``/``k_norm`` included); neither the embedding nor an
lm_head (vLLM shares the target's). The trained mask vector goes to ``mask_embedding.pt``, which vLLM writes into
the embedding row of ``mask_token_id``. ``config.json`` is a Qwen3 config of the head's shapes with the target's
RoPE, and ``dflash_config``: the mask id and ``target_layer_ids``, the 0-based target layers whose outputs it reads
(aux id k - 1: the output of layer k - 1 is the input of block k).
"""

from __future__ import annotations

import torch

from mtp_train.heads.base import HeadSpec

MASK_FILE = "mask_embedding.pt"


def to_dflash(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``head_to_hf`` of a dflash head -> vLLM's weights and the mask vector ``[H]``."""
    out = dict(tensors)
    return out, out.pop("mask_embedding")


def dflash_config(spec: HeadSpec) -> dict:
    """vLLM's ``config.json`` for the head (the block size is recorded, vLLM runs blocks of ``1 + k``)."""
    cfg = spec.target
    rope = {"rope_type": cfg.rope.kind, "rope_theta": cfg.rope.theta}
    if cfg.rope.kind == "llama3":
        rope.update(factor=cfg.rope.factor, low_freq_factor=cfg.rope.low_freq_factor,
                    high_freq_factor=cfg.rope.high_freq_factor,
                    original_max_position_embeddings=cfg.rope.original_max_positions)
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions, "attention_bias": False,
            "rope_theta": cfg.rope.theta, "rope_parameters": rope, "tie_word_embeddings": False,
            "torch_dtype": "float32", "block_size": spec.block_size,
            "dflash_config": {"mask_token_id": spec.mask_token_id,
                              "target_layer_ids": [k - 1 for k in spec.aux_layers]}}
