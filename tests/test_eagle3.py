"""EAGLE-3 heads: the layers precompute stores for them, training-time test against chained drafting, the draft
vocabulary, the trainer's refusals, and the export in vLLM's, SGLang's and speculators' layouts (EXPORT.md 3-4),
served by vLLM where its CPU build is installed (`make vllm`)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli, vllm_check
from mtp_train.errors import UserError
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.attention import DocumentCausalAttention
from mtp_train.heads.eagle3 import aux_layers_for, default_aux_layers
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.runtime.drafters import HeadDrafter
from mtp_train.runtime.engine import Engine
from mtp_train.train.checkpoint import load_head
from mtp_train.train.ttt import TTTAttention
from mtp_train.train.vocab import frequent_tokens
from mtp_train.features.reader import FeatureReader

def _run(recipe: Path) -> Path:
    return recipe.parent / "run"


def test_precompute_stores_the_layers_the_head_reads(eagle3_run):
    reader = FeatureReader(_run(eagle3_run) / "features")
    assert reader.manifest.layers == [0, 1, 2, 3]  # outputs of layers k - 1 for aux ids 1, 2, 3, and the last
    config = json.loads((_run(eagle3_run) / "heads" / "eagle3" / "config.json").read_text())
    assert (config["aux_layers"], config["draft_vocab"]) == ([1, 2, 3], 1024)


def test_the_engines_default_aux_layers():
    cfg = FrozenTarget.load(TINY_TARGET).cfg
    deep = dataclasses.replace(cfg, num_layers=30)
    assert default_aux_layers(deep) == [2, 15, 27]  # vLLM's and SGLang's (2, L//2, L-3)
    with pytest.raises(UserError, match=r"head.aux_layers: the engines' default \[2, 2, 1\]"):
        default_aux_layers(cfg)  # 4 layers: not three distinct layers
    with pytest.raises(UserError, match="three distinct ascending ids in 1..4"):
        aux_layers_for([0, 1, 2], cfg)
    assert aux_layers_for([2, 3, 4], cfg) == [2, 3, 4]  # 4: the last layer's output, as vLLM captures it


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("window", [0, 6])
def test_training_time_test_computes_what_chained_drafting_computes(steps, window):
    """Step j at row i of TTT equals the head run causally over the sequence the runtime's draft holds when it drafts
    there: the target-fed positions 0..i, then its own chain inputs at i+1..i+j (each fed its previous output). With
    a window (``head.window``), step j stands at position i + j: it sees the step-0 keys above i + j - window, as the
    chain step drafting there sees its window."""
    frozen = FrozenTarget.load(TINY_TARGET)
    torch.manual_seed(0)
    head = build_head(head_spec("eagle3", 1, frozen.cfg, "x", aux_layers=(1, 2, 3), draft_vocab=512,
                                window=window)).eval()
    n = 24
    tokens = torch.randint(0, frozen.cfg.vocab_size, (n,))
    g = head.project(torch.randn(n, 3 * frozen.cfg.hidden_size))
    rows = torch.arange(n)
    plan, hidden, outs = TTTAttention([0, n], window), g, []
    with torch.no_grad():
        for j in range(steps):
            embeds = frozen.embed(tokens[(rows + 1 + j).clamp(max=n - 1)])
            hidden = head(embeds, hidden, rows + j, plan)
            outs.append(hidden)
        for i in range(n - steps):
            seq_tokens, seq_hidden = list(tokens[1 : i + 2]), list(g[: i + 1])
            for j in range(steps):
                length = i + 1 + j
                out = head.run(frozen.embed(torch.stack(seq_tokens)), torch.stack(seq_hidden), torch.arange(length),
                               DocumentCausalAttention([0, length], window), [(None, None)])[-1]
                torch.testing.assert_close(outs[j][i], out, rtol=1e-5, atol=1e-5)
                if j + 1 < steps:
                    seq_tokens.append(tokens[i + 2 + j])
                    seq_hidden.append(out)


def test_the_draft_vocabulary_is_the_most_frequent_assistant_tokens_and_drafts_stay_in_it(eagle3_run):
    head = load_head(_run(eagle3_run) / "heads" / "eagle3")
    reader = FeatureReader(_run(eagle3_run) / "features")
    assert torch.equal(head.draft_ids, frequent_tokens(reader, 1024, 4096))
    engine = Engine.from_pretrained(TINY_TARGET)
    drafter = HeadDrafter(engine, head)
    assert drafter.capture == (0, 1, 2)
    logits = drafter.logits(torch.randn(5, engine.cfg.hidden_size))
    finite = torch.isfinite(logits)
    assert finite.sum(-1).tolist() == [1024] * 5 and finite[:, head.draft_ids].all()


def test_the_trainer_refuses_features_without_the_heads_layers(trained_run):
    proc = run_cli("train", trained_run, "head.kind=eagle3", "head.aux_layers=[1,2,3]", timeout=300)
    assert_one_line_user_error(proc, "features hold the outputs of layers [3]", "[0, 1, 2] are missing",
                               "mtp-train precompute")
    assert not (_run(trained_run) / "heads" / "eagle3").exists()


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_an_eagle3_head_exports_in_the_engines_layout(eagle3_run, tmp_path, fmt):
    out = tmp_path / fmt
    proc = run_cli("export", eagle3_run, "--format", fmt, "--out", out)
    assert proc.returncode == 0, proc.stderr
    tensors = load_file(out / "model.safetensors")
    layer = "layers.0." if fmt == "speculators" else "midlayer."
    h, q, kv, inter = 128, 128, 64, 384
    want = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (1024, h), "d2t": (1024,), "t2d": (4096,),
            **{layer + k: v for k, v in {
                "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
                "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
                "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
                "input_layernorm.weight": (h,), "hidden_norm.weight": (h,),
                "post_attention_layernorm.weight": (h,)}.items()}}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    ids = load_head(_run(eagle3_run) / "heads" / "eagle3").draft_ids
    assert torch.equal(torch.arange(1024) + tensors["d2t"], ids)  # target id = draft id + d2t[draft id]
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 1024 and tensors["t2d"][ids].all()
    config = _load_json(out / "config.json")
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 1024
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert config["norm_before_residual"] is False  # (vLLM's bridge defaults it to true when absent)
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 1024
        # not the default [2, 2, 1]: written, in each engine's numbering (SGLang's Llama adds 1)
        want_ids = [1, 2, 3] if fmt == "vllm" else [0, 1, 2]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == want_ids
        # vLLM's also at the top level, which only vLLM reads (and prefers): the file says which engine it is for
        assert config.get("eagle_aux_hidden_state_layer_ids") == ([1, 2, 3] if fmt == "vllm" else None)
    if fmt == "sglang":
        assert "--speculative-algorithm EAGLE3" in (out / "README.md").read_text()


def test_speculators_holds_eagle3_heads_only(trained_run, tmp_path):
    proc = run_cli("export", trained_run, "--format", "speculators", "--out", tmp_path / "out")
    assert_one_line_user_error(proc, "--format speculators", "head.kind=eagle3")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt, ks", [("vllm", ["1", "3"]), ("speculators", ["2"])])
def test_vllm_serves_the_exported_eagle3_head_as_this_runtime_does(eagle3_run, tmp_path, fmt, ks):
    """Like the eagle head's check (test_export.py), with the draft vocabulary's d2t mapping in play."""
    proc = vllm_check(eagle3_run, tmp_path / "work", "--format", fmt, "--k", *ks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"PASS: {len(ks)}/{len(ks)} k within 3%" in proc.stdout


def test_an_eagle3_head_needs_one_layer_of_standard_attention(eagle3_run, tmp_path):
    recipe = yaml.safe_load(eagle3_run.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["precompute"]["features_dir"] = str(_run(eagle3_run) / "features")
    recipe["head"]["num_layers"] = 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert_one_line_user_error(run_cli("train", path, timeout=300), "eagle3 head has one decoder layer")


@pytest.mark.slow
def test_two_processes_train_an_eagle3_head_as_one_does(eagle3_run, tmp_path):
    """DDP over gloo (torchrun, 2 processes) against one process with 2 micro-batches: the same losses, and the
    two ranks' weights identical (training-time test calls the wrapped head once per unrolled step)."""
    logs = {}
    for name, launch, accum in (("one", [], 2), ("two", ["-m", "torch.distributed.run", "--standalone",
                                                          "--nproc_per_node", "2"], 1)):
        recipe = yaml.safe_load(eagle3_run.read_text())
        recipe["output_dir"] = str(tmp_path / name)
        recipe["precompute"]["features_dir"] = str(_run(eagle3_run) / "features")
        recipe["train"].update(max_steps=4, grad_accum=accum, batch_tokens=1024, val_every=4, save_every=4)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        cmd = [sys.executable, *launch, "-m", "mtp_train.cli", "train", str(path)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "ACCELERATE_USE_CPU": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name] = [json.loads(line) for line in (tmp_path / name / "train_log.eagle3.jsonl").read_text().splitlines()]
    digests = _load_json(tmp_path / "two" / "heads" / "eagle3" / "config.json")["rank_weight_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]
    for a, b in zip(logs["one"], logs["two"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


def test_a_frozen_lm_head_stays_at_the_targets_rows_while_the_rest_trains(eagle3_run, tmp_path):
    """``train.freeze_lm_head``: after 4 steps at a high lr the saved head's lm_head is still the target's rows of its
    draft ids, bit for bit, while its loss fell; the recipe's own run (not frozen) moved its lm_head."""
    recipe = yaml.safe_load(eagle3_run.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["precompute"]["features_dir"] = str(_run(eagle3_run) / "features")
    recipe["train"].update(max_steps=4, lr=1e-2, warmup_steps=0, val_every=4, save_every=4, freeze_lm_head=True)
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("train", path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = FrozenTarget.load(TINY_TARGET).lm_head_weight
    frozen, trained = load_head(tmp_path / "run" / "heads" / "eagle3"), load_head(_run(eagle3_run) / "heads" / "eagle3")
    assert torch.equal(frozen.lm_head.weight, rows[frozen.draft_ids].to(frozen.lm_head.weight.dtype))
    assert not torch.equal(trained.lm_head.weight, rows[trained.draft_ids].to(trained.lm_head.weight.dtype))
    lines = (tmp_path / "run" / "train_log.eagle3.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
