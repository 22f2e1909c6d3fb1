"""The command line: one-line user errors with exit 2, dry-run, stage status, fast --help."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY_RECIPE, TINY_TARGET, assert_one_line_user_error, run_cli, stand_in_checkpoint


def test_help_is_fast_and_imports_no_torch():
    start = time.perf_counter()
    proc = run_cli("--help")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0
    assert "precompute" in proc.stdout and "verify" in proc.stdout
    assert elapsed < 2.0, f"--help took {elapsed:.2f}s"
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, mtp_train.cli as c; c.build_parser(); "
         "print(sorted(m for m in ('torch', 'transformers', 'pydantic', 'yaml') if m in sys.modules))"],
        capture_output=True, text=True, check=True,
    )
    assert probe.stdout.strip() == "[]"


def test_missing_recipe_file():
    assert_one_line_user_error(run_cli("nope.yaml"), "nope.yaml", "not found")


def test_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target: {path: [\n")
    assert_one_line_user_error(run_cli(path), str(path), "invalid YAML")


def test_unknown_key(tmp_path):
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["train"]["learning_rate"] = 1e-3
    data["target"]["path"] = str(TINY_TARGET)
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_one_line_user_error(run_cli(path), str(path), "train.learning_rate", "unknown key")


def test_wrong_type():
    assert_one_line_user_error(run_cli(TINY_RECIPE, "train.epochs=many"), "train.epochs", "valid number")


def test_negative_lr():
    assert_one_line_user_error(run_cli(TINY_RECIPE, "train.lr=-0.1"), "train.lr", "greater than 0")


def test_tp_that_does_not_divide_the_heads():
    heads = json.loads((TINY_TARGET / "config.json").read_text())["num_attention_heads"]
    assert_one_line_user_error(run_cli(TINY_RECIPE, f"target.tp={heads + 1}"), "target.tp", f"{heads} attention heads")


def test_tp_that_does_not_divide_the_kv_heads():
    config = json.loads((TINY_TARGET / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    assert heads != kv, "the tiny target uses GQA"
    tp = next(t for t in range(2, heads + 1) if heads % t == 0 and kv % t)
    assert_one_line_user_error(run_cli(TINY_RECIPE, f"target.tp={tp}"), "target.tp", f"{kv} KV heads")


def test_missing_target_checkpoint(tmp_path):
    assert_one_line_user_error(run_cli(TINY_RECIPE, f"target.path={tmp_path / 'gone'}"), "target.path", "not found")


def test_target_without_weights(tmp_path):
    (tmp_path / "config.json").write_text((TINY_TARGET / "config.json").read_text())
    assert_one_line_user_error(run_cli(TINY_RECIPE, f"target.path={tmp_path}"), "target.path", "model.safetensors")


def test_unsupported_family_is_named_before_any_missing_key(tmp_path):
    """A GPT-2 config has no num_attention_heads: the family is what to report, with the supported ones."""
    gpt2 = {"model_type": "gpt2", "n_head": 12, "n_embd": 768, "n_layer": 12, "vocab_size": 50257}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_user_error(run_cli(TINY_RECIPE, f"target.path={tmp_path}"), "model_type 'gpt2' is not supported",
                               "llama, mistral, qwen2, qwen3")


def test_sharded_index_naming_a_missing_file(tmp_path):
    (tmp_path / "config.json").write_text((TINY_TARGET / "config.json").read_text())
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_user_error(run_cli(TINY_RECIPE, f"target.path={tmp_path}"), "model-00001-of-00002.safetensors")


def test_bad_override_syntax():
    assert_one_line_user_error(run_cli(TINY_RECIPE, "train.lr"), "train.lr", "KEY.PATH=VALUE")


def test_unknown_flag_is_one_line():
    assert_one_line_user_error(run_cli(TINY_RECIPE, "--frobnicate"), "--frobnicate")


def test_dry_run_prints_resolved_recipe_and_plan():
    proc = run_cli(TINY_RECIPE, "--dry-run", "train.lr=5e-4", "head.kind=eagle")
    assert proc.returncode == 0, proc.stderr
    resolved_text, plan = proc.stdout.split("plan:\n")
    resolved = yaml.safe_load(resolved_text)
    assert resolved["train"]["lr"] == pytest.approx(5e-4)
    assert resolved["head"]["kind"] == "eagle"
    assert resolved["train"]["grad_clip"] == 1.0, "defaults are filled in"
    assert Path(resolved["target"]["path"]) == TINY_TARGET.resolve()
    steps = [line.split()[1] for line in plan.split("memory per rank")[0].strip().splitlines()]
    assert steps == ["precompute", "train", "eval", "report"]
    assert "eagle head" in plan


def test_dry_run_of_one_stage_plans_only_that_stage():
    proc = run_cli("train", TINY_RECIPE, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout.split("plan:\n")[1].split("memory per rank")[0]
    assert [line.split()[1] for line in plan.strip().splitlines()] == ["train"]


def test_dry_run_flag_may_come_first():
    assert run_cli("--dry-run", TINY_RECIPE).returncode == 0


def test_dry_run_still_refuses_bad_input():
    assert_one_line_user_error(run_cli(TINY_RECIPE, "--dry-run", "head.num_layers=0"), "head.num_layers")


def test_report_before_eval_is_a_one_line_error(tmp_path):
    assert_one_line_user_error(run_cli("report", TINY_RECIPE, f"output_dir={tmp_path / 'out'}"), "run `mtp-train eval` first")


def test_verify_of_a_missing_directory_is_a_user_error(tmp_path):
    assert_one_line_user_error(run_cli("verify", tmp_path / "nope"), "features directory not found")


@pytest.mark.slow
def test_full_run_goes_through_every_stage_then_skips_them(tmp_path):
    args = (TINY_RECIPE, f"output_dir={tmp_path / 'out'}", "data.max_rows=40", "data.heldout_rows=4",
            "train.max_steps=2", "train.wandb_mode=disabled", "eval.k=[1]", "eval.temperatures=[0]",
            "eval.prompt_sets=[heldout]", "eval.max_prompts=2", "eval.max_new_tokens=8", "eval.compare=[bigram]")
    proc = run_cli(*args, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = tmp_path / "out" / "eval" / "report.html"
    assert f"the report is {report}" in proc.stdout and report.is_file()
    assert (tmp_path / "out" / "features" / "manifest.json").is_file()
    assert (tmp_path / "out" / "heads" / "mtp" / "model.safetensors").is_file()
    again = run_cli(*args, timeout=600)
    assert again.returncode == 0 and "skipped" in again.stderr and again.stderr.count("skipped") == 3


def test_samples_dry_run_against_their_real_model_configs(tmp_path):
    """The 70B sample's TP=8 divides Llama-3.3-70B's 64 heads and 8 KV heads, and its dry run prints the memory plan
    that the recipe's comment states. (The dry run also renders the first rows of the data with the tokenizer: here
    the tiny target's, over a small file in the sample's format.)"""
    stand_in_checkpoint(tmp_path, REPO / "recipes/configs/llama-3.3-70b.json")
    proc = run_cli(REPO / "recipes/llama3.3-70b.yaml", f"target.path={tmp_path}",
                   f"data.train={tmp_path / 'data.jsonl'}", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    memory = proc.stdout.split("memory per rank")[1].split("disk for")[0].splitlines()[1:]
    assert len(memory) == 3 and all(f"# {line}\n" in (REPO / "recipes/llama3.3-70b.yaml").read_text() for line in memory)
    assert_one_line_user_error(
        run_cli(REPO / "recipes/llama3.3-70b.yaml", f"target.path={tmp_path}", "target.tp=16", "--dry-run"),
        "16 does not divide the target's 8 KV heads",
    )


def test_runs_from_any_working_directory(tmp_path):
    shutil.copy(TINY_RECIPE, tmp_path / "copy.yaml")
    proc = run_cli(REPO / "recipes" / "tiny.yaml", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
