"""HF checkpoint -> runtime parameters, in one table, and safetensors loading.

Weights are read with ``safetensors.safe_open`` only, tensor by tensor, and sliced for this
tensor-parallel rank before they are materialised, so no rank ever holds the whole model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from mtp_train.errors import UserError
from mtp_train.hf_checkpoint import CheckpointFiles, find_checkpoint
from mtp_train.models.config import ModelConfig
from mtp_train.models.rope import RotaryEmbedding
from mtp_train.models.tp import TensorParallel
from mtp_train.models.transformer import Transformer

COLUMN, ROW = 0, 1  # TP split along output rows (column-parallel) or input columns (row-parallel)
Source = tuple[str, int | None]  # (HF name, TP split or None for replicated)

# Runtime parameter -> the HF tensors it is made of, concatenated along dim 0 in this order
# (q|k|v and gate|up are fused into one matmul each). Layer entries are relative to the layer.
GLOBAL_PARAMS: dict[str, list[Source]] = {
    "tok_embeddings.weight": [("model.embed_tokens.weight", None)],
    "norm.weight": [("model.norm.weight", None)],
    "output.weight": [("lm_head.weight", None)],
}
_NORMS: dict[str, list[Source]] = {
    "attention_norm.weight": [("input_layernorm.weight", None)],
    "ffn_norm.weight": [("post_attention_layernorm.weight", None)],
}
_GEMMA_NORMS: dict[str, list[Source]] = {  # Gemma 3: a norm before and after each of attention and the MLP
    "attention_norm.weight": [("input_layernorm.weight", None)],
    "post_attention_norm.weight": [("post_attention_layernorm.weight", None)],
    "ffn_norm.weight": [("pre_feedforward_layernorm.weight", None)],
    "post_ffn_norm.weight": [("post_feedforward_layernorm.weight", None)],
}
_ATTENTION: dict[str, list[Source]] = {
    "attention.wqkv.weight": [(f"self_attn.{x}_proj.weight", COLUMN) for x in "qkv"],
    "attention.wqkv.bias": [(f"self_attn.{x}_proj.bias", COLUMN) for x in "qkv"],
    "attention.wo.weight": [("self_attn.o_proj.weight", ROW)],
    "attention.wo_bias": [("self_attn.o_proj.bias", None)],
    "attention.q_norm.weight": [("self_attn.q_norm.weight", None)],
    "attention.k_norm.weight": [("self_attn.k_norm.weight", None)],
}
_LATENT_ATTENTION: dict[str, list[Source]] = {  # DeepSeek's MLA (models/mla.py); heads split by rows of q and kv_b
    "attention.wq.weight": [("self_attn.q_proj.weight", COLUMN)],
    "attention.wq_a.weight": [("self_attn.q_a_proj.weight", None)],
    "attention.q_a_norm.weight": [("self_attn.q_a_layernorm.weight", None)],
    "attention.wq_b.weight": [("self_attn.q_b_proj.weight", COLUMN)],
    "attention.wkv_a.weight": [("self_attn.kv_a_proj_with_mqa.weight", None)],
    "attention.kv_a_norm.weight": [("self_attn.kv_a_layernorm.weight", None)],
    "attention.wkv_b.weight": [("self_attn.kv_b_proj.weight", COLUMN)],
    "attention.wo.weight": [("self_attn.o_proj.weight", ROW)],
}


def _mlp(prefix: str, ours: str) -> dict[str, list[Source]]:
    return {
        f"{ours}w_gate_up.weight": [(f"{prefix}gate_proj.weight", COLUMN), (f"{prefix}up_proj.weight", COLUMN)],
        f"{ours}w_gate_up.bias": [(f"{prefix}gate_proj.bias", COLUMN), (f"{prefix}up_proj.bias", COLUMN)],
        f"{ours}w_down.weight": [(f"{prefix}down_proj.weight", ROW)],
        f"{ours}w_down_bias": [(f"{prefix}down_proj.bias", None)],
    }


def _experts(num_experts: int) -> dict[str, list[Source]]:
    """DeepSeek's MoE (models/moe.py): per-expert HF tensors stacked into one runtime tensor, expert-major."""
    return {
        "feed_forward.router.weight": [("mlp.gate.weight", None)],
        "feed_forward.router.bias": [("mlp.gate.e_score_correction_bias", None)],
        "feed_forward.w_gate_up": [(f"mlp.experts.{e}.{x}_proj.weight", COLUMN)
                                   for e in range(num_experts) for x in ("gate", "up")],
        "feed_forward.w_down": [(f"mlp.experts.{e}.down_proj.weight", ROW) for e in range(num_experts)],
        **_mlp("mlp.shared_experts.", "feed_forward.shared."),
    }


def layer_params(cfg: ModelConfig, moe: bool = False) -> dict[str, list[Source]]:
    """Runtime layer parameter (relative to the layer) -> its HF tensors, for a decoder layer of ``cfg``'s family,
    with experts when ``moe``."""
    table = {**(_GEMMA_NORMS if cfg.sandwich_norms else _NORMS),
             **(_LATENT_ATTENTION if cfg.mla is not None else _ATTENTION)}
    table.update(_experts(cfg.moe.num_experts) if moe and cfg.moe is not None else _mlp("mlp.", "feed_forward."))
    return table


_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
FLOAT32_PARAMS = ("router.weight", "router.bias")  # kept in float32 whatever the model's dtype, as HF keeps them


def hf_sources(name: str, cfg: ModelConfig) -> list[Source]:
    """The HF tensors (and their TP split) that make up runtime parameter ``name``."""
    if name in GLOBAL_PARAMS:
        return GLOBAL_PARAMS[name]
    m = _OURS_LAYER.match(name)
    table = layer_params(cfg, cfg.is_moe_layer(int(m.group(1)))) if m else {}
    if m and m.group(2) in table:
        return [(f"model.layers.{m.group(1)}.{hf}", split) for hf, split in table[m.group(2)]]
    raise KeyError(name)


def weight_locations(ckpt: CheckpointFiles) -> dict[str, Path]:
    """Every tensor name in the checkpoint -> the file holding it (headers only)."""
    where: dict[str, Path] = {}
    for path in ckpt.weight_files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                where[key] = path
    return where


def read_tensors(root: Path, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read only the HF tensors ``names`` from a checkpoint (single file or sharded index)."""
    ckpt = find_checkpoint(root)
    where = weight_locations(ckpt)
    out = {}
    for name in names:
        if name not in where:
            raise UserError(f"{root}: tensor {name!r} is missing from the checkpoint")
        with safe_open(where[name], framework="pt") as f:
            t = f.get_tensor(name)
        out[name] = t if dtype is None else t.to(dtype)
    return out


def _read_shard(f, name: str, split: int | None, tp: TensorParallel) -> torch.Tensor:
    if split is None or tp.size == 1:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    start, stop = tp.shard(sl.get_shape()[split], f"rows of {name}")
    return sl[start:stop] if split == COLUMN else sl[:, start:stop]


def load_transformer(
    root: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallel = TensorParallel(),
) -> Transformer:
    """Build the runtime model for an HF checkpoint directory and load its weights (this rank's shard).

    On the ``meta`` device no weight is read: the model has its shapes and config only (a rank that does not
    run it, e.g. a draft under tensor parallelism off the leader).
    """
    ckpt = find_checkpoint(root)
    cfg = ModelConfig.from_hf(ckpt.config, str(root / "config.json"))
    with torch.device("meta"):
        model = Transformer(cfg, tp)
    if torch.device(device).type == "meta":
        return model.eval().requires_grad_(False)
    where = weight_locations(ckpt)
    handles: dict[Path, object] = {}
    state: dict[str, torch.Tensor] = {}
    try:
        for name in model.state_dict():
            sources = hf_sources(name, cfg)
            if name == "output.weight" and "lm_head.weight" not in where and cfg.tie_word_embeddings:
                sources = GLOBAL_PARAMS["tok_embeddings.weight"]
            parts = []
            for hf, split in sources:
                if hf not in where:
                    raise UserError(f"{root}: weight {hf!r} is missing from the checkpoint")
                if where[hf] not in handles:
                    handles[where[hf]] = safe_open(where[hf], framework="pt")
                parts.append(_read_shard(handles[where[hf]], hf, split, tp))
            keep = torch.float32 if name.endswith(FLOAT32_PARAMS) else dtype
            state[name] = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device=device, dtype=keep)
    finally:
        handles.clear()
    if cfg.tie_word_embeddings and "lm_head.weight" not in where:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope).to(device)
    if cfg.local_rope is not None:
        model.local_rope = RotaryEmbedding(cfg.head_dim, cfg.local_rope).to(device)
    return model.eval().requires_grad_(False)


def _part_sizes(suffix: str, cfg: ModelConfig, rows: int, parts: int) -> list[int]:
    """Row counts of the ``parts`` HF tensors fused into runtime layer parameter ``suffix`` (``rows`` rows, TP 1)."""
    if suffix.startswith("attention.wqkv"):
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    return [rows // parts] * parts  # gate|up, and stacked experts: equal parts


def _is_moe(suffixes) -> bool:
    return any(s.startswith("feed_forward.router.") for s in suffixes)


def layer_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """One decoder layer's runtime tensors (names relative to the layer) -> HF names, unfused."""
    table = layer_params(cfg, _is_moe(state))
    out = {}
    for suffix, tensor in state.items():
        sources = table[suffix]
        parts = [tensor] if len(sources) == 1 else tensor.split(_part_sizes(suffix, cfg, tensor.shape[0], len(sources)))
        for (hf, _), part in zip(sources, parts, strict=True):
            out[hf] = part.contiguous()
    return out


def layer_from_hf(hf: dict[str, torch.Tensor], wanted: list[str], source: str, cfg: ModelConfig
                  ) -> dict[str, torch.Tensor]:
    """HF tensors of one decoder layer (names relative to the layer) -> the runtime tensors ``wanted``."""
    table = layer_params(cfg, _is_moe(wanted))
    out = {}
    for suffix in wanted:
        names = [name for name, _ in table[suffix]]
        missing = [n for n in names if n not in hf]
        if missing:
            raise UserError(f"{source}: tensor {missing[0]!r} is missing")
        out[suffix] = torch.cat([hf[n] for n in names]) if len(names) > 1 else hf[names[0]]
    return out


def read_layer(root: Path, index: int, wanted: list[str], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Runtime tensors of the target's decoder layer ``index``, read selectively (fp32): those of ``wanted`` that a
    layer of its type has (a MoE layer gives a dense head no MLP)."""
    table = layer_params(cfg, cfg.is_moe_layer(index))
    wanted = [w for w in wanted if w in table]
    prefix = f"model.layers.{index}."
    names = sorted({prefix + hf for suffix in wanted for hf, _ in table[suffix]})
    ckpt = find_checkpoint(root)
    available = set(weight_locations(ckpt))
    hf = read_tensors(root, [n for n in names if n in available], torch.float32)
    return layer_from_hf({k.removeprefix(prefix): v for k, v in hf.items()}, wanted, str(root), cfg)
