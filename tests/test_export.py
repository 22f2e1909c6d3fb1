"""`mtp-train export`: eagle heads in vLLM's and SGLang's layouts (names, shapes, config keys of EXPORT.md section 2),
one-line refusals that write nothing, the model card; and, where vLLM's CPU build is installed (`make vllm`), the
exported head served by vLLM against this runtime (bench/vllm_check.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli, vllm_check


@pytest.fixture(scope="module")
def eagle_run(trained_run, tmp_path_factory) -> Path:
    """The trained run's features, and an eagle head trained on them for 10 steps, in a run of its own."""
    tmp = tmp_path_factory.mktemp("eagle")
    recipe = yaml.safe_load(trained_run.read_text())
    recipe["output_dir"] = str(tmp / "run")
    recipe["head"] = {"kind": "eagle"}
    recipe["train"].update(max_steps=10, val_every=10, save_every=10)
    shutil.copytree(trained_run.parent / "run" / "features", tmp / "run" / "features")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("train", path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def _tensors(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _layout(h: int, inter: int, q: int, kv: int, layers: int = 1) -> dict[str, tuple[int, ...]]:
    """EXPORT.md section 2: fc [H, 2H] without bias, layers.{i}.* in HF names without `model.`, no layer-0
    input_layernorm, no embedding, no lm_head, no final norm."""
    out = {"fc.weight": (h, 2 * h)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "post_attention_layernorm.weight": (h,)})
        if i > 0:
            out[p + "input_layernorm.weight"] = (h,)
    return out


@pytest.mark.parametrize("fmt, arch", [("vllm", "EagleLlamaForCausalLM"), ("sglang", "LlamaForCausalLMEagle")])
def test_an_eagle_head_exports_in_the_engines_layout(eagle_run, tmp_path, fmt, arch):
    out = tmp_path / "exported"
    proc = run_cli("export", eagle_run, "--format", fmt, "--out", out)
    assert proc.returncode == 0, proc.stderr
    target = json.loads((TINY_TARGET / "config.json").read_text())
    h, heads, kv_heads = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    hd = h // heads
    want = _layout(h, target["intermediate_size"], heads * hd, kv_heads * hd)
    if fmt == "sglang":
        want["fc.bias"] = (h,)
    assert _tensors(out / "model.safetensors") == want
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch] and config["num_hidden_layers"] == 1
    assert config["hidden_size"] == h and config["vocab_size"] == target["vocab_size"]
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):  # the draft inherits the target's RoPE
        assert config.get(key) == target.get(key), key
    assert config["max_position_embeddings"] == target["max_position_embeddings"]
    assert config["mtp_train"]["hidden_input"] == "post_norm" and config["mtp_train"]["feedback"] == "output"
    if fmt == "sglang":
        with safe_open(out / "model.safetensors", framework="pt") as f:
            assert not f.get_tensor("fc.bias").any()
    card = (out / "README.md").read_text()
    assert "eagle draft head" in card and str(TINY_TARGET) in card and "10 training steps" in card
    assert not list(tmp_path.glob(".*.tmp")), "the temporary directory was renamed into place"


def test_the_model_card_carries_the_reports_block(eagle_run, tmp_path):
    """The exported README holds the report's model-card block, the one on top of report.md and in model_card.md:
    τ and engine MAL per k, α₁, the best measured speedup, lossless, and where the head is valid."""
    from mtp_train.eval.model_card import card_markdown
    from mtp_train.eval.report import load_report

    assert run_cli("eval", eagle_run, timeout=600).returncode == 0
    out = tmp_path / "exported"
    assert run_cli("export", eagle_run, "--format", "vllm", "--out", out).returncode == 0
    card = (out / "README.md").read_text()
    eval_dir = eagle_run.parent / "run" / "eval"
    report = load_report(eval_dir / "report.json")
    block = card_markdown(report)
    assert block.rstrip() in card and block == (eval_dir / "model_card.md").read_text()
    assert (eval_dir / "report.md").read_text().split("\n", 2)[2].startswith(block), "report.md opens with it"
    greedy = sorted((p for p in report.sweep if p.temperature == 0), key=lambda p: p.k)
    taus = " / ".join(f"{p.tau:.2f}" for p in greedy) + " at k = " + " / ".join(str(p.k) for p in greedy)
    mals = " / ".join(f"{p.engine_acceptance.mean_acceptance_length:.2f}" for p in greedy)
    assert f"**τ** (tokens per target step, bonus included, T = 0): {taus}" in card and mals in card
    assert "10 training steps" in card and "**Best measured speedup**: " in card
    assert report.serving.startswith("Valid in vLLM and SGLang") and f"**Valid for**: {report.serving}" in card


def test_an_mtp_head_on_a_llama_target_is_refused_and_nothing_is_written(trained_run, tmp_path):
    out = tmp_path / "exported"
    proc = run_cli("export", trained_run, "--format", "vllm", "--out", out)
    assert_one_line_user_error(proc, "an mtp head on a llama target cannot be exported for vLLM",
                               "serve it with this runtime")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_head_trained_for_another_target_is_refused(eagle_run, tmp_path):
    other = tmp_path / "target"
    shutil.copytree(TINY_TARGET, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2  # same shapes, another model
    (other / "config.json").write_text(json.dumps(config))
    out = tmp_path / "exported"
    proc = run_cli("export", eagle_run, f"target.path={other}", "--format", "vllm", "--out", out)
    assert_one_line_user_error(proc, "trained for a different target")
    assert not out.exists()


def test_a_head_in_other_conventions_is_refused_naming_the_difference(eagle_run, tmp_path):
    recipe = yaml.safe_load(eagle_run.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    shutil.copytree(eagle_run.parent / "run" / "heads", tmp_path / "run" / "heads")
    config_path = tmp_path / "run" / "heads" / "eagle" / "config.json"
    config = json.loads(config_path.read_text())
    config["hidden_input"] = "pre_norm"
    config_path.write_text(json.dumps(config))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("export", path, "--format", "sglang")
    assert_one_line_user_error(proc, "other conventions than SGLang", "before its final norm", "after its final norm")
    assert not (tmp_path / "run" / "export").exists()


def test_export_without_a_trained_head_or_with_an_unknown_format_is_a_one_line_error(tmp_path):
    proc = run_cli("export", REPO / "recipes" / "tiny.yaml", f"output_dir={tmp_path / 'out'}", "head.kind=eagle",
                   "--format", "vllm")
    assert_one_line_user_error(proc, "no trained eagle head", "mtp-train train")
    proc = run_cli("export", REPO / "recipes" / "tiny.yaml", "--format", "tensorrt")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_vllm_serves_the_exported_head_as_this_runtime_does(eagle_run, tmp_path):
    """(a) vLLM's speculative output is its plain output; (b) its 1 + accepted / drafts and (c) its accepted counts
    per position are within 3% of this runtime's for the same head, prompts, k and max tokens."""
    if not (eagle_run.parent / "run" / "eval" / "report.json").is_file():
        assert run_cli("eval", eagle_run, timeout=600).returncode == 0
    proc = vllm_check(eagle_run, tmp_path / "work", "--k", "1", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: 2/2 k within 3%" in proc.stdout
    report = json.loads((eagle_run.parent / "run" / "eval" / "report.json").read_text())
    assert sorted(c["k"] for c in report["engine_checks"]) == [1, 3]
    assert "Served by an engine" in (eagle_run.parent / "run" / "eval" / "report.md").read_text()
