"""One dataclass describing every supported decoder family, parsed from an HF ``config.json``.

DeepSeek-V2/V3 add two optional parts: ``mla`` (multi-head latent attention) and ``moe`` (routed and shared
experts); the Llama families leave both ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mtp_train.errors import UserError
from mtp_train.hf_checkpoint import require_family


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; ``kind`` is ``default``, ``llama3`` (Llama 3.1 frequency scaling) or ``yarn``
    (DeepSeek's: ``beta_fast``/``beta_slow`` bound the ramp between interpolated and original frequencies;
    ``mscale``/``mscale_all_dim`` set the cos/sin factor and the softmax scale)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Per token the cache holds the ``kv_lora_rank`` latent and the
    ``qk_rope_head_dim`` rope key, shared by all heads; ``q_lora_rank`` None means a plain ``q_proj``.
    ``rope_interleave``: the rope dimensions come in interleaved pairs (both versions' checkpoints)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with shared experts (DeepSeek-V2/V3); layers ``< first_dense_layers`` keep the dense MLP.

    ``scoring``: ``softmax`` (V2) or ``sigmoid`` (V3, which chooses with the score plus a per-expert correction bias);
    ``group_limited``: top-k within the ``topk_group`` best of ``n_group`` expert groups (a group scores its best
    expert under softmax, its best two under sigmoid); ``norm_topk_prob`` renormalises the chosen weights
    before ``routed_scaling_factor``."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    num_shared_experts: int
    first_dense_layers: int
    scoring: str
    group_limited: bool
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder.

    ``qkv_bias`` is Qwen2's (or Llama's ``attention_bias``, which also sets ``o_bias``); ``qk_norm`` is Qwen3's and
    Gemma 3's per-head RMSNorm on queries and keys; ``sliding_window`` is Mistral's (None means full attention).
    Gemma 3's: ``norm_offset`` (every RMSNorm scales by ``offset + weight``), ``embed_scale`` (the embeddings times
    √hidden), ``sandwich_norms`` (norms after attention and after the MLP too, before their residuals),
    ``activation`` (``gelu_tanh``), ``layer_windows`` (per layer a sliding window, 0 for global attention; empty:
    every layer ``sliding_window``) and ``local_rope`` (the rope of the windowed layers).
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
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    activation: str = "silu"
    layer_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None

    @property
    def torch_only(self) -> str | None:
        """What of this model only the runtime's torch attention implements, or None."""
        if self.mla is not None:
            return "MLA (DeepSeek)"
        return "per-layer sliding windows (Gemma 3)" if self.layer_windows else None

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (None: it attends globally)."""
        return (self.layer_windows[index] or None) if self.layer_windows else self.sliding_window

    def plain_layer(self) -> ModelConfig:
        """The config of a draft head's decoder layer for this target: the target's own, but for a Gemma 3 target a
        Llama layer of its sizes and global rope (the engines' EAGLE drafters are Llama layers for every target)."""
        if not self.sandwich_norms:
            return self
        return replace(self, norm_offset=0.0, embed_scale=1.0, sandwich_norms=False, activation="silu",
                       qk_norm=False, layer_windows=(), local_rope=None)

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index >= self.moe.first_dense_layers

    def kv_entry(self, tp_size: int = 1) -> tuple[int, int, int]:
        """What one layer caches per token on one rank: ``(heads, key dim, value dim)``. MLA caches one latent
        ``[kv_lora_rank + qk_rope_head_dim]`` per token, replicated on every rank, and no separate value."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.num_kv_heads // tp_size, self.head_dim, self.head_dim

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of ``dataclasses.asdict`` (a head's ``config.json`` stores its target's config so)."""
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        data["mla"] = MLAConfig(**data["mla"]) if data.get("mla") else None
        data["moe"] = MoEConfig(**data["moe"]) if data.get("moe") else None
        data["local_rope"] = RopeConfig(**data["local_rope"]) if data.get("local_rope") else None
        data["layer_windows"] = tuple(data.get("layer_windows", ()))
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        family = require_family(hf, source)
        if family == "gemma3_text":
            return _gemma3_from_hf(cls, hf, source)

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
        deepseek = family.startswith("deepseek")
        if deepseek and hf.get("attention_bias"):
            raise UserError(f"{source}: attention_bias is not supported for {family}; no released checkpoint sets it")
        mla = _mla_from_hf(hf, need) if deepseek else None
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=mla.qk_rope_head_dim if mla else int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_positions=int(hf.get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(hf, source),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            mla=mla,
            moe=_moe_from_hf(hf, family, need, source) if deepseek and hf.get("n_routed_experts") else None,
        )


def _mla_from_hf(hf: dict[str, Any], need) -> MLAConfig:
    q_lora = hf.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
        # DeepSeek-V2's rope is interleaved always (transformers rotates it as complex pairs); V3 says so in its config.
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _moe_from_hf(hf: dict[str, Any], family: str, need, source: str) -> MoEConfig:
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise UserError(f"{source}: moe_layer_freq {hf['moe_layer_freq']} is not supported; every layer from "
                        "first_k_dense_replace on is a MoE layer (moe_layer_freq 1)")
    v3 = family == "deepseek_v3"
    scoring = hf.get("scoring_func", "sigmoid" if v3 else "softmax")
    method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
    expected = ("sigmoid", ("noaux_tc",)) if v3 else ("softmax", ("greedy", "group_limited_greedy"))
    if scoring != expected[0] or method not in expected[1]:
        raise UserError(f"{source}: {family} routing scoring_func={scoring!r}, topk_method={method!r} is not "
                        f"supported; supported: scoring_func={expected[0]!r}, topk_method in {list(expected[1])}")
    norm_topk = bool(hf.get("norm_topk_prob", v3))
    if norm_topk and not v3:
        raise UserError(f"{source}: norm_topk_prob true is not supported for {family} (released V2 checkpoints "
                        "set it false, and transformers ignores it); set it to false")
    return MoEConfig(
        num_experts=int(need("n_routed_experts")),
        experts_per_token=int(need("num_experts_per_tok")),
        intermediate_size=int(need("moe_intermediate_size")),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        first_dense_layers=int(hf.get("first_k_dense_replace", 0)),
        scoring=scoring,
        group_limited=v3 or method == "group_limited_greedy",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=norm_topk,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def _rope_from_hf(hf: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "yarn":
        return RopeConfig(
            theta=theta,
            kind="yarn",
            factor=float(params["factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    if kind != "llama3":
        raise UserError(f"{source}: rope type {kind!r} is not supported; supported: default, llama3, yarn")
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


def _gemma3_from_hf(cls: type[ModelConfig], hf: dict[str, Any], source: str) -> ModelConfig:
    """Gemma 3's text decoder (``gemma3_text``): sliding and global layers (``layer_types``), each kind with its own
    rope; the options this runtime does not implement are refused in one line."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise UserError(f"{source}: {key} {hf[key]} is not supported (Gemma 3 sets it null); set it to null")
    if hf.get("use_bidirectional_attention"):
        raise UserError(f"{source}: use_bidirectional_attention is not supported; set it to false")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(f"{source}: hidden_activation {hf['hidden_activation']!r} is not supported; supported: "
                        "gelu_pytorch_tanh")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    if float(hf.get("query_pre_attn_scalar", head_dim)) != head_dim:
        raise UserError(f"{source}: query_pre_attn_scalar {hf['query_pre_attn_scalar']} is not supported: this "
                        f"runtime scales attention by head_dim ** -0.5 (head_dim {head_dim})")
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [
        "full_attention" if (i + 1) % int(hf.get("sliding_window_pattern", 6)) == 0 else "sliding_attention"
        for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise UserError(f"{source}: layer_types must give sliding_attention or full_attention for each of the "
                        f"{layers} layers")
    window = int(hf.get("sliding_window") or 0)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer kind
        full, local = (_rope_from_hf({"rope_parameters": params[k]}, source)
                       for k in ("full_attention", "sliding_attention"))
    else:  # the released config: rope_theta (+ rope_scaling) globally, rope_local_base_freq in the windows
        full = _rope_from_hf(hf, source)
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0)))
    return cls(
        family="gemma3_text", vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]), num_layers=layers, num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), max_positions=int(hf.get("max_position_embeddings", 32768)),
        rope=full, tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
        norm_offset=1.0, embed_scale=hidden**0.5, sandwich_norms=True, activation="gelu_tanh",
        layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds), local_rope=local)
