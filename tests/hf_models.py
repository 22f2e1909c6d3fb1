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
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(root, **kwargs)
    return model
