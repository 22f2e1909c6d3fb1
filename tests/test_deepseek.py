"""DeepSeek targets beyond logit parity (which tests/test_runtime_parity.py covers for both versions): greedy
decoding against transformers, the latent KV cache, routing that matters, TP = 2, and DeepSeek's MTP layer as a
ready draft: a checkpoint's own MTP layer in the official layout, a head trained here exported to that layout and
loaded back as ``target_mtp`` with the trained head's acceptance."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli
from hf_models import save_random_model
from mtp_train.errors import UserError
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams

SMALL_V3 = dict(  # a V3 shape small enough to train a head on in seconds
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=2, topk_group=1, max_position_embeddings=2048, bos_token_id=0, eos_token_id=3, pad_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_greedy_decoding_matches_transformers(family, tmp_path):
    model = save_random_model(family, tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17)]
    engine = Engine.from_pretrained(tmp_path, page_size=4)
    ours = [r.tokens for r in engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=()))]
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert tokens == ref[0, len(prompt):].tolist()


def test_the_cache_holds_the_latent_not_k_and_v(tmp_path):
    """Per token and layer: the 512 latent + 64 rope channels, once for all heads (not 2 x heads x head dim)."""
    save_random_model("deepseek_v2", tmp_path)
    engine = Engine.from_pretrained(tmp_path, page_size=4, kv_bytes=2**20)
    assert engine.kv.k.shape[2:] == (4, 1, 512 + 64) and engine.kv.v.numel() == 0
    per_token = engine.cfg.num_layers * (512 + 64) * 4  # fp32
    assert engine.allocator.num_pages == 2**20 // (4 * per_token)


def test_the_routing_is_exercised(tmp_path):
    """V3's correction bias, the group limit and the routed experts each change the logits: none is a no-op."""
    model = save_random_model("deepseek_v3", tmp_path)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(tokens).logits
        layer = model.model.layers[1].mlp
        bias = layer.gate.e_score_correction_bias.clone()
        layer.gate.e_score_correction_bias.zero_()
        assert (model(tokens).logits - base).abs().max() > 1e-3
        layer.gate.e_score_correction_bias.copy_(bias)
    engine = Engine.from_pretrained(tmp_path)
    moe = engine.model.layers[1].feed_forward
    x = torch.randn(64, engine.cfg.hidden_size)
    weights, ids = moe.router(x)
    experts_per_group = engine.cfg.moe.num_experts // engine.cfg.moe.n_group
    groups = ids // experts_per_group
    assert (groups == groups[:, :1]).all(), "topk_group 1: every token's experts come from one group"
    unlimited = dataclasses.replace(moe.router.moe, topk_group=2)
    moe.router.moe = unlimited
    free = moe.router(x)[1] // experts_per_group
    assert (free != free[:, :1]).any(), "without the limit some token takes experts from both groups"
    assert torch.allclose(weights.sum(-1), torch.full((64,), 2.5)), "normalised, then scaled by 2.5"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_tp2_over_gloo_matches_tp1(tmp_path, family):
    """Heads split over 2 ranks, the latent replicated, every expert on both ranks sliced by channel: the TP = 1
    results."""
    save_random_model(family, tmp_path / "target")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 20)]
    torch.save(prompts, tmp_path / "prompts.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "tp_worker.py"), str(tmp_path / "target"), str(tmp_path / "prompts.pt"),
           str(tmp_path / "out.pt"), "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = torch.load(tmp_path / "out.pt", weights_only=True)
    assert tp2["heads_per_rank"] == 2 and tp2["speculative_tokens"] == tp2["tokens"]
    engine = Engine.from_pretrained(tmp_path / "target", page_size=16)
    tp1 = engine.score(prompts, layers=[-1], topk=16)
    assert torch.equal(tp2["topk_ids"], tp1.topk_ids)
    assert (tp2["topk_logprobs"] - tp1.topk_logprobs).abs().max() <= 1e-4
    tokens = [r.tokens for r in engine.generate(prompts, SamplingParams(max_new_tokens=16, stop_token_ids=()))]
    assert tp2["tokens"] == tokens


def test_unsupported_deepseek_options_are_refused(tmp_path):
    from mtp_train.models.config import ModelConfig

    hf = json.loads(json.dumps({**SMALL_V3, "model_type": "deepseek_v2", "n_routed_experts": 4}))
    with pytest.raises(UserError, match="moe_layer_freq 2 is not supported"):
        ModelConfig.from_hf({**hf, "moe_layer_freq": 2})
    with pytest.raises(UserError, match="scoring_func='sigmoid'"):
        ModelConfig.from_hf({**hf, "scoring_func": "sigmoid"})
    save_random_model("deepseek_v2", tmp_path)
    with pytest.raises(UserError, match="flashinfer is not wired for MLA"):
        from mtp_train.runtime.attention import select_backend

        select_backend("flashinfer", torch.device("cpu"), None, torch_only="MLA (DeepSeek)")


# -- DeepSeek's MTP layer as a draft ------------------------------------------------------------------------------

def _official_mtp_target(root: Path) -> Path:
    """A random V3 target whose checkpoint holds one MTP layer in DeepSeek's own layout (EXPORT.md 1.1): layer
    L = num_hidden_layers is transformers' decoder layer (built as layer L of an (L+1)-layer model) plus enorm,
    hnorm, eh_proj, shared_head.norm/head and embed_tokens, written here by name, not by this toolkit's export."""
    save_random_model("deepseek_v3", root, **{**SMALL_V3, "num_hidden_layers": SMALL_V3["num_hidden_layers"] + 1})
    n, h = SMALL_V3["num_hidden_layers"], SMALL_V3["hidden_size"]
    tensors = load_file(root / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    p = f"model.layers.{n}."
    tensors.update({p + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    p + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    p + "eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=g),
                    p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (root / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_TARGET / name, root / name)
    return root


def _shapes(path: Path, prefix: str) -> dict[str, tuple[int, ...]]:
    with safe_open(path, framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory) -> Path:
    """The official-layout target, and an mtp head trained for it in vLLM's convention (10 steps)."""
    from precompute_helpers import make_recipe, sgd_rows, write_jsonl

    tmp = tmp_path_factory.mktemp("deepseek_mtp")
    target = _official_mtp_target(tmp / "target")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(24, split="train"))
    recipe = make_recipe(
        tmp, data, target={"path": str(target)}, precompute={"layers": [-1], "topk": 8},
        head={"kind": "mtp", "convention": "vllm"},
        train={"batch_tokens": 2048, "max_steps": 10, "val_every": 10, "save_every": 10, "wandb_mode": "disabled"},
        eval={"k": [1, 2], "temperatures": [0.0], "prompt_sets": ["spec_bench"], "max_prompts": 6,
              "max_new_tokens": 16},
    )
    for stage in ("precompute", "train"):
        proc = run_cli(stage, recipe, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return recipe


@pytest.mark.slow
def test_a_checkpoints_own_mtp_layer_is_a_ready_draft(mtp_run, tmp_path):
    """eval.draft=target_mtp decodes with the checkpoint's MTP layer, untrained here, losslessly, in vLLM's
    convention, and says so in the report."""
    recipe = yaml.safe_load(mtp_run.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["eval"]["draft"] = "target_mtp"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("eval", path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["mode"] == "target_mtp" and report["lossless"]
    assert report["head_convention"].startswith("vllm: reads the target's hidden state after its final norm")
    assert "Valid in vLLM" in report["serving"]


@pytest.mark.slow
def test_an_exported_head_is_the_official_layout_and_loads_back_as_target_mtp(mtp_run, tmp_path):
    out = tmp_path / "exported"
    proc = run_cli("export", mtp_run, "--format", "vllm", "--out", out)
    assert proc.returncode == 0, proc.stderr
    target = Path(yaml.safe_load(mtp_run.read_text())["target"]["path"])
    n = SMALL_V3["num_hidden_layers"]
    layer = f"model.layers.{n}."
    # Names and shapes: exactly those of the official MTP layer in the target checkpoint.
    assert _shapes(out / "model.safetensors", "") == _shapes(target / "model.safetensors", layer)
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == n
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]

    # The head, written over the checkpoint's MTP layer, drafts as target_mtp exactly as the trained head did.
    swapped = tmp_path / "swapped"
    shutil.copytree(target, swapped)
    tensors = {**load_file(target / "model.safetensors"), **load_file(out / "model.safetensors")}
    save_file(tensors, swapped / "model.safetensors", metadata={"format": "pt"})
    runs = {}
    for name, root, draft in (("trained", target, "head"), ("loaded", swapped, "target_mtp")):
        recipe = yaml.safe_load(mtp_run.read_text())
        recipe["target"]["path"] = str(root)
        recipe["output_dir"] = str(tmp_path / name)
        recipe["eval"]["draft"] = draft
        if name == "trained":
            shutil.copytree(Path(mtp_run).parent / "run" / "heads", tmp_path / name / "heads")
            shutil.copytree(Path(mtp_run).parent / "run" / "features", tmp_path / name / "features")
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        proc = run_cli("eval", path, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "eval" / "report.json").read_text())
    taus = {name: [(p["k"], p["tau"], p["alpha"], p["num_steps"]) for p in r["sweep"]] for name, r in runs.items()}
    assert taus["loaded"] == taus["trained"]


def test_target_mtp_without_an_mtp_layer_is_a_one_line_error(trained_run, tmp_path):
    recipe = yaml.safe_load(trained_run.read_text())
    recipe["eval"]["draft"] = "target_mtp"
    recipe["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert_one_line_user_error(run_cli("eval", path), "target_mtp needs a DeepSeek-V3-layout checkpoint",
                               "num_nextn_predict_layers")


def test_an_mtp_head_of_a_v2_target_is_not_exported(tmp_path):
    """vLLM and SGLang turn only DeepSeek-V3-family configs into their MTP model: a V2 target's head is refused."""
    from mtp_train.export import _check_servable, check_format
    from mtp_train.heads.conventions import choices

    with pytest.raises(UserError, match="no serving engine loads an MTP layer for this family .*DeepSeek-V3-family"):
        check_format("mtp", "deepseek_v2", "vllm", tmp_path, 1)
    check_format("mtp", "deepseek_v3", "vllm", tmp_path, 1)
    _check_servable("mtp", choices("mtp", "vllm"), "deepseek_v3", "vllm", tmp_path)  # served: no error
    with pytest.raises(UserError, match="head.convention=sglang"):
        _check_servable("mtp", choices("mtp", "vllm"), "deepseek_v3", "sglang", tmp_path)
