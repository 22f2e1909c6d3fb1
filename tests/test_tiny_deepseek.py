"""The tiny DeepSeek-V2 target: HF format, MLA and MoE, offline-loadable, the tiny Llama's tokenizer, the quality
bar, and the same greedy output through transformers and through this project's runtime."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, TINY_TARGET, greedy_distinct2, hf_model, hf_tokenizer, run_cli

DEEPSEEK_TARGET = REPO / "recipes" / "tiny-deepseek" / "target"
DEEPSEEK_RECIPE = REPO / "recipes" / "tiny-deepseek.yaml"
QUALITY = json.loads((DEEPSEEK_TARGET / "quality.json").read_text())
CONFIG = json.loads((DEEPSEEK_TARGET / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return hf_tokenizer(DEEPSEEK_TARGET)


@pytest.fixture(scope="module")
def model():
    return hf_model(DEEPSEEK_TARGET)


@pytest.fixture(scope="module")
def engine():
    from mtp_train.runtime.engine import Engine

    return Engine.from_pretrained(DEEPSEEK_TARGET, page_size=16)


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )["input_ids"]


def test_ships_the_hf_files_within_25_mb():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "quality.json"):
        assert (DEEPSEEK_TARGET / name).is_file(), name
    total = sum(f.stat().st_size for f in DEEPSEEK_TARGET.iterdir())
    assert total <= 25 * 2**20, f"{total / 2**20:.1f} MiB"


def test_reuses_the_tiny_llamas_tokenizer_and_template_byte_for_byte():
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (DEEPSEEK_TARGET / name).read_bytes() == (TINY_TARGET / name).read_bytes(), name
    stops = json.loads((DEEPSEEK_TARGET / "generation_config.json").read_text())["eos_token_id"]
    assert stops == json.loads((TINY_TARGET / "generation_config.json").read_text())["eos_token_id"]


def test_config_is_deepseek_v2_with_mla_moe_and_yarn():
    c = CONFIG
    assert c["model_type"] == "deepseek_v2" and c["architectures"] == ["DeepseekV2ForCausalLM"]
    # MLA: no query low-rank (as V2-Lite), a compressed KV latent, split nope/rope query-key dims.
    assert c["q_lora_rank"] is None
    assert 0 < c["kv_lora_rank"] < c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"])
    assert c["qk_nope_head_dim"] > 0 and c["qk_rope_head_dim"] > 0 and c["v_head_dim"] > 0
    # MoE: dense first, then routed experts by V2's greedy softmax top-k, plus a shared expert.
    assert 0 < c["first_k_dense_replace"] < c["num_hidden_layers"]
    assert c["n_routed_experts"] > c["num_experts_per_tok"] > 1 and c["n_shared_experts"] >= 1
    assert c["topk_method"] == "greedy" and c["scoring_func"] == "softmax" and c["norm_topk_prob"] is False
    rope = c["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["mscale"] == rope["mscale_all_dim"] == 0.707
    assert c["max_position_embeddings"] == rope["factor"] * rope["original_max_position_embeddings"]


def test_checkpoint_holds_mla_and_moe_weights():
    from safetensors import safe_open

    with safe_open(DEEPSEEK_TARGET / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    dense = CONFIG["first_k_dense_replace"]
    for i in range(CONFIG["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn."
        assert {attn + "q_proj.weight", attn + "kv_a_proj_with_mqa.weight", attn + "kv_a_layernorm.weight",
                attn + "kv_b_proj.weight", attn + "o_proj.weight"} <= keys, i
        mlp = f"model.layers.{i}.mlp."
        routed = [k for k in keys if k.startswith(mlp + "experts.")]
        if i < dense:
            assert mlp + "gate_proj.weight" in keys and not routed, i
        else:
            assert routed and mlp + "gate.weight" in keys and mlp + "shared_experts.gate_proj.weight" in keys, i


def test_is_a_small_deepseek_in_transformers(model):
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= params <= 5_000_000
    assert params == QUALITY["parameters"]


def test_quality_bar_is_comparable_to_the_tiny_llama():
    llama = json.loads((TINY_TARGET / "quality.json").read_text())
    assert QUALITY["dev_loss"] <= llama["dev_loss"] + 0.3
    assert QUALITY["distinct_2_of_50_greedy"] >= 0.15


def test_dev_loss_measured_on_the_sgd_dev_split(model, tokenizer):
    """As for the tiny Llama, with the build script's own function: the next-token loss on the first 32 windows of
    256 tokens of the dev split."""
    from mtp_train.tools.tiny_target import dev_loss, encode_dialogues, pack, read_sgd

    windows = pack(encode_dialogues(tokenizer, read_sgd("dev")[:60]), 256)[:32]
    assert windows.shape[0] == 32
    assert dev_loss(model, windows, batch_size=32) <= 2.6
    model.eval()  # dev_loss leaves the model in train mode


@pytest.mark.slow
def test_greedy_replies_to_50_dev_prompts_are_varied(model, tokenizer):
    """Distinct-2 of greedy continuations of the build script's 50 dev prompts (batched), as for the tiny Llama."""
    assert greedy_distinct2(model, tokenizer, QUALITY["seed"]) >= 0.15


def test_greedy_output_through_transformers_equals_the_stored_expectation(model, tokenizer):
    import torch

    from mtp_train.tools.tiny_target import max_repeat_fraction

    for item in QUALITY["fixed_prompts"]:
        ids = torch.tensor([prompt_ids(tokenizer, item["prompt"])])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=len(item["greedy_ids"]), pad_token_id=tokenizer.pad_token_id,
            )
        reply = out[0, ids.shape[1]:].tolist()
        assert reply == item["greedy_ids"]
        assert max_repeat_fraction(reply) < 0.2, item["prompt"]  # no loop
        assert len(tokenizer.decode(reply, skip_special_tokens=True).split()) >= 3, item["prompt"]


def test_greedy_output_through_the_runtime_equals_the_stored_expectation(engine, tokenizer):
    """The runtime reads the checkpoint as DeepSeek (MLA over a latent KV cache, MoE) and decodes, batched, the same
    greedy replies; each stops at its end of turn like transformers' did."""
    from mtp_train.runtime.sampling import SamplingParams

    assert engine.cfg.mla is not None and engine.cfg.moe is not None
    items = QUALITY["fixed_prompts"]
    prompts = [prompt_ids(tokenizer, item["prompt"]) for item in items]
    params = [SamplingParams(temperature=0.0, max_new_tokens=len(item["greedy_ids"])) for item in items]
    for item, result in zip(items, engine.generate(prompts, params)):
        assert result.tokens == item["greedy_ids"], item["prompt"]


def test_runtime_logits_match_transformers_in_prefill_and_paged_decode(model, engine):
    """The trained weights (not random ones) through the runtime's packed prefill and page-by-page decode."""
    import torch

    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.sequence import Sequence

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG["vocab_size"], (120,), generator=g).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float()
    seq = Sequence(0, [], SamplingParams(), frozenset(), 0)
    rows = []
    for start, end in [(0, 100), *((i, i + 1) for i in range(100, 120))]:
        engine.reserve([(seq, tokens[start:end])])
        _, hidden, _ = engine.forward([(seq, tokens[start:end])])
        rows.append(engine.model.logits(hidden if start else hidden[-1:]))
    engine.release(seq)
    ours = torch.cat(rows)
    assert ours.shape == ref[99:].shape
    assert (ours - ref[99:]).abs().max().item() <= 1e-4
    assert torch.equal(ours.argmax(-1), ref[99:].argmax(-1))


def test_recipe_dry_run_resolves_the_deepseek_target():
    proc = run_cli(DEEPSEEK_RECIPE, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "tiny-deepseek" in proc.stdout


@pytest.mark.slow
def test_recipe_runs_end_to_end_on_a_slice(tmp_path):
    """The shipped recipe, shrunk (24 dialogues of up to 256 tokens, 20 steps, 4 held-out prompts at k = 1, 2 and
    T = 0), runs through precompute, train, eval and report on the DeepSeek target."""
    proc = run_cli(
        DEEPSEEK_RECIPE, f"output_dir={tmp_path / 'run'}", "data.max_rows=24", "data.max_length=256",
        "data.heldout_rows=4", "train.max_steps=20", "train.val_every=20", "train.save_every=20",
        "train.wandb_mode=disabled",
        "eval.k=[1,2]", "eval.temperatures=[0.0]", "eval.prompt_sets=[heldout]", "eval.max_prompts=4",
        "eval.max_new_tokens=32", timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless"] is True  # float32 target: speculative decoding at T = 0 is token-identical to plain
    assert {(p["k"], p["temperature"]) for p in report["sweep"]} >= {(1, 0.0), (2, 0.0)}
    assert report["tau"] >= 1.0 and len(report["val_loss"]) == 2
    assert (tmp_path / "run" / "eval" / "report.md").is_file()
