"""One dataclass describing every supported decoder family, parsed from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.errors import UserError
from mtp_train.hf_checkpoint import require_family


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; ``kind`` is ``default`` or ``llama3`` (Llama 3.1 frequency scaling)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder.

    ``qkv_bias`` is Qwen2's (or Llama's ``attention_bias``, which also sets ``o_bias``); ``qk_norm`` is Qwen3's per-head RMSNorm on queries and keys;
    ``sliding_window`` is Mistral's (None means full attention).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        family = require_family(hf, source)

        def need(key: str) -> Any:
            if key not in hf:
                raise UserError(f"{source}: key {key!r} is missing")
            return hf[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        sliding = None
        if family == "mistral":
            sliding = hf.get("sliding_window")
        elif hf.get("use_sliding_window"):
            raise UserError(f"{source}: use_sliding_window is not supported for {family}; set it to false")
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_positions=int(hf.get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(hf, source),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
        )


def _rope_from_hf(hf: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "llama3":
        raise UserError(f"{source}: rope type {kind!r} is not supported; supported: default, llama3")
    return RopeConfig(
        theta=theta,
        kind="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_positions=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )
