"""Build the tiny DeepSeek-V2 target that ships in ``recipes/tiny-deepseek/target/``.

Reproduce it with::

    .venv/bin/python -m mtp_train.tools.tiny_deepseek --out recipes/tiny-deepseek/target

A ``DeepseekV2ForCausalLM`` shaped like DeepSeek-V2-Lite at a tiny size: MLA attention without a query
low-rank (``q_lora_rank`` null, a 64-wide KV latent, 32 + 16 query/key dims per head, 32 value dims), one dense
layer first and then MoE layers (4 routed experts, 2 per token by greedy softmax top-k without renormalisation,
1 shared expert) and YaRN rope with V2-Lite's mscales. Everything else is the tiny Llama's (``tiny_target``): the
same tokenizer and chat template, copied from ``recipes/tiny/target`` (no tokenizer training), the same SGD
windows, training loop and quality bar in ``quality.json``; only the budget differs (0.9 epochs, 2.9M tokens,
against the Llama's 2), to keep the build under 10 minutes. Seeded and CPU-only; it prints its wall time (470 s
on 2 cores, dev loss 2.26; 2,194,304 parameters).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from mtp_train.tools.tiny_target import (
    END_OF_TURN,
    EOS,
    REPO,
    add_training_args,
    encode_dialogues,
    measure_quality,
    pack,
    print_quality,
    read_sgd,
    seed_and_threads,
    train_lm,
)

LLAMA_TARGET = REPO / "recipes" / "tiny" / "target"
# The tokenizer and template travel as files, byte for byte, so both tiny targets tokenize identically.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# YaRN as in DeepSeek-V2-Lite (factor 40 over 4096 positions there), scaled down: 4 x 512 = 2048 positions.
ROPE = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=512,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)


def make_config(tokenizer, **overrides):
    from transformers import DeepseekV2Config

    options = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        max_position_embeddings=int(ROPE["factor"] * ROPE["original_max_position_embeddings"]),
        rope_parameters=dict(ROPE),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
        pad_token_id=tokenizer.pad_token_id,
    )
    options.update(overrides)
    return DeepseekV2Config(**options)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "recipes" / "tiny-deepseek" / "target")
    p.add_argument("--tokenizer-from", type=Path, default=LLAMA_TARGET, help="tokenizer files from here")
    add_training_args(p, epochs=0.9)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2ForCausalLM

    seed_and_threads(args)
    t0 = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from, local_files_only=True)
    train_dialogues, dev_dialogues = read_sgd("train"), read_sgd("dev")
    train = pack(encode_dialogues(tokenizer, train_dialogues), args.seq_len)
    dev = pack(encode_dialogues(tokenizer, dev_dialogues), args.seq_len)
    print(f"tokenizer: {len(tokenizer)} tokens; train {train.numel():,} tokens, dev {dev.numel():,} tokens")

    config = make_config(tokenizer)
    model = DeepseekV2ForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    total_steps = train_lm(model, train, args.batch_size, args.epochs, args.lr, args.seed, t0)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.convert_tokens_to_ids(EOS)]
    model.save_pretrained(args.out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.tokenizer_from / name, args.out / name)
    # The quality bar is measured on the checkpoint as written, loaded the way its users (and tests) load it.
    del model
    model = AutoModelForCausalLM.from_pretrained(args.out, local_files_only=True, dtype=torch.float32)
    quality = measure_quality(
        model, tokenizer, dev, dev_dialogues, args.seed, total_steps * args.batch_size * args.seq_len
    )
    quality["train_seconds"] = round(time.time() - t0, 1)
    (args.out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    print_quality(quality)
    print(f"wall time {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
