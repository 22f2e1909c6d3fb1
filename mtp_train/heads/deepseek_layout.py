"""An ``mtp`` head in DeepSeek-V3's checkpoint layout, both ways (``../shared/EXPORT.md`` section 1.1).

DeepSeek stores its MTP layers inside the target checkpoint, as layers ``L = num_hidden_layers`` on:
``model.layers.{L}.enorm / hnorm / eh_proj / shared_head.norm`` plus a decoder layer of the target's own type in
the usual names (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``), and copies of the
embedding (``embed_tokens``) and lm_head (``shared_head.head``), which both engines replace by the target's.

- ``to_deepseek``: a one-layer head's tensors in that layout (the export);
- ``from_deepseek``: the inverse, with which ``train.checkpoint.load_target_mtp`` reads a checkpoint's own MTP
  layer as a head (``eval.draft: target_mtp``).
"""

from __future__ import annotations

import torch

SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the target's, loaded from the target


def to_deepseek(head_tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """``train.checkpoint.head_to_hf`` output of a one-layer ``mtp`` head -> ``model.layers.{layer}.*`` names."""
    prefix = f"model.layers.{layer}."
    out = {}
    for name, tensor in head_tensors.items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            raise ValueError("the DeepSeek layout holds one decoder layer per MTP layer")
        out[prefix + name.removeprefix("layers.0.")] = tensor
    return out


def from_deepseek(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The inverse of ``to_deepseek``: ``model.layers.{layer}.*`` -> the head's names, shared copies dropped."""
    prefix = f"model.layers.{layer}."
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    out = {}
    for name, tensor in tensors.items():
        rest = name.removeprefix(prefix)
        if rest in SHARED_COPIES:
            continue
        out[rest if rest.startswith(own) else "layers.0." + rest] = tensor
    return out
