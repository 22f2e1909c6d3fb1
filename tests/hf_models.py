"""Tiny random HF checkpoints of every supported family, built in-process (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

FAMILY_OPTIONS = {
    # Llama 3.1 frequency scaling with a short original context so every frequency band is exercised.
    "llama": dict(
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )
    ),
    "mistral": dict(sliding_window=12, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen2": dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3": dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # Gemma 3: windowed and global layers, each kind with its own rope, a window the parity tests' 30 tokens pass.
    "gemma3_text": dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                             full_attention=dict(rope_type="default", rope_theta=1000000.0)),
    ),
    # DeepSeek at real head and rope sizes (qk 128 + 64, v 128, latent 512), a few small experts, YaRN as released
    # (V2-Lite's rope; for V3 an mscale pair whose cos/sin factor is not 1), one dense layer first.
    "deepseek_v2": dict(
        **(_DEEPSEEK := dict(
            num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1,
        )),
        topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        max_position_embeddings=2560, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    ),
    "deepseek_v3": dict(
        **{**_DEEPSEEK, "q_lora_rank": 96}, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=2560, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707),
    ),
}


def hf_config(family: str, **overrides):
    from transformers import AutoConfig

    options = {**BASE, **FAMILY_OPTIONS[family], **overrides}
    return AutoConfig.for_model(family, **options)


def save_random_model(family: str, root: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Build a random ``family`` model, save it as an HF checkpoint under ``root`` and return it (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random biases and norm weights, so that a dropped term shows up
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # DeepSeek's router: scores far enough apart to route
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a correction that changes the choice
                b.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(root, **kwargs)
    return model


def peer_inputs(directory: Path) -> tuple[Path, Path]:
    """What the peer runners' tests train on (bench/peers/): 4 rows of 40 ids below 128, the first 10 masked out, as
    ``tokens.jsonl``, and a 64-id draft vocabulary (the even ids) as ``vocab.safetensors`` (d2t, t2d)."""
    import json

    from safetensors.torch import save_file

    rows = [{"input_ids": [(7 * i + j) % 128 for j in range(40)], "loss_mask": [0] * 10 + [1] * 30} for i in range(4)]
    (directory / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    used = torch.arange(0, 128, 2)
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[used] = True
    save_file({"d2t": used - torch.arange(64), "t2d": t2d}, directory / "vocab.safetensors")
    return directory / "tokens.jsonl", directory / "vocab.safetensors"


def imported_head_decodes_losslessly(src: Path, target: Path, layout: str | None = None):
    """The head a peer wrote at ``src``, imported for ``target`` (``mtp-train import``'s path), drafts in this
    runtime at k = 2 with the greedy output of plain decoding; returns the imported head."""
    import json

    from mtp_train.importer import import_head
    from mtp_train.models.config import ModelConfig
    from mtp_train.runtime.drafters import head_drafter
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.speculative import SpeculativeDecoder

    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    head, _ = import_head(src, target, cfg, layout)
    engine = Engine.from_pretrained(target, num_pages=64)
    prompts = [[(5 * i + j) % 128 for j in range(12)] for i in range(3)]
    params = [SamplingParams(max_new_tokens=10, stop_token_ids=(), seed=s) for s in range(3)]
    plain = [r.tokens for r in engine.generate(prompts, params)]
    spec = SpeculativeDecoder(engine, head_drafter(engine, head), 2).generate(prompts, params)
    assert [r.tokens for r in spec] == plain
    return head
