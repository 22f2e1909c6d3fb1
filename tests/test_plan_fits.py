"""The memory plan at 70B: eagle3 and dflash heads fit an H100 (attention that keeps no scores, dflash's blocks a
chunk at a time, as ``train.anchors`` sets them), the runtime's buffers come out of the KV budget, and a plan that
does not fit is refused, by ``--dry-run`` and at the start of training on a GPU, saying what would fit."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import REPO, TINY_RECIPE, TINY_TARGET, stand_in_checkpoint
from mtp_train.errors import UserError
from mtp_train.head_memory import dflash_activation_terms, head_saved_bytes, train_activation_bytes
from mtp_train.memory import GIB, H100_BYTES, check_fits, memory_plan, plan_lines
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe
from mtp_train.runtime.reserve import NCCL_BYTES, flashinfer_backend_bytes, reserved_bytes

RECIPE = REPO / "recipes" / "llama3.3-70b.yaml"
CONFIG = REPO / "recipes" / "configs" / "llama-3.3-70b.json"


def _config(path=CONFIG) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(path.read_text()))


def _train(*overrides: str):
    return memory_plan(_config(), load_recipe(RECIPE, list(overrides)))[1]


def test_the_70b_eagle3_and_dflash_heads_fit_an_h100():
    """They planned 256.6 and 447.7 GiB per rank, every document's scores kept; the recipe's comment states them."""
    comments = RECIPE.read_text()
    for kind in ("eagle3", "dflash"):
        train = _train(f"head.kind={kind}")
        assert train.fits and "the chunked attention kernel" in train.line(), train.line()
        assert f"# head.kind={kind}:{train.line()}\n" in comments, f"{kind}: the recipe's comment is stale"


def test_the_dflash_plan_counts_the_anchors_train_anchors_sets():
    every, some = _train("head.kind=dflash"), _train("head.kind=dflash", "train.anchors=64")
    assert some.parts["activations"] < every.parts["activations"] and some.parts["loss"] < every.parts["loss"]
    assert "blocks of 9 at every anchor of 16,384 tokens, 8,190 block rows at a time" in every.line()
    # 64 per document of 8,192 tokens, two such documents a batch: 128 blocks, all in one chunk of 1,152 rows
    assert "at 128 anchors (64 per document of 8,192 tokens) of 16,384 tokens, 1,152 block rows at a time" in some.line()


def test_the_dflash_terms_are_what_a_real_forward_of_blocks_keeps():
    """Counted without memory per context row and per block row; a real CPU forward over two documents at some
    anchors keeps exactly that beside one of them."""
    recipe = load_recipe(TINY_RECIPE, ["head.kind=dflash", "head.aux_layers=[1,2,3]", "head.block_size=4",
                                       "eval.k=[1,2,3]", "eval.trees=[]"])  # (blocks of 4 draft 3 at most)
    cfg = _config(TINY_TARGET / "config.json")
    per_context_row, per_block_row = dflash_activation_terms(recipe, cfg)
    anchors = [torch.tensor([0, 5, 9, 30]), torch.tensor([3, 4, 17])]
    # a real forward under the plan's bf16 autocast; the difference of two batches leaves out autocast's weight copies
    real = (head_saved_bytes(recipe, cfg, [0, 40, 64], device="cpu", anchors=anchors)
            - head_saved_bytes(recipe, cfg, [0, 40], device="cpu", anchors=anchors[:1]))
    assert real == 24 * per_context_row + 3 * 4 * per_block_row
    assert per_block_row > cfg.hidden_size * 4 > 0 < per_context_row


def test_the_runtime_buffers_come_out_of_the_kv_budget():
    cfg, recipe = _config(), load_recipe(RECIPE, ["precompute.mode=online"])
    assert reserved_bytes(1, 8) == flashinfer_backend_bytes() + NCCL_BYTES  # TP 8: one NCCL communicator
    offline = memory_plan(cfg, load_recipe(RECIPE))
    precompute, train, evaluation = offline
    assert precompute.parts["buffers"] == reserved_bytes(1, 8)  # one backend
    assert evaluation.parts["buffers"] == reserved_bytes(2, 8)  # the engine's and the head drafter's
    fraction = int(recipe.target.gpu_memory_fraction * H100_BYTES)
    assert precompute.parts["KV"] == fraction - precompute.parts["weights"] - precompute.parts["buffers"]
    assert memory_plan(cfg, recipe)[1].parts["buffers"] == reserved_bytes(1, 8)  # online: the scoring engine's
    torch_backend = memory_plan(cfg, load_recipe(RECIPE, ["target.attention_backend=torch"]))[0]
    assert torch_backend.parts["buffers"] == NCCL_BYTES  # no FlashInfer workspace
    single = memory_plan(cfg, load_recipe(RECIPE, ["target.attention_backend=torch", "target.tp=1"]))[0]
    assert "buffers" not in single.parts


def test_a_plan_that_does_not_fit_is_refused_with_what_would_fit_planned_again():
    cfg, recipe = _config(), load_recipe(RECIPE, ["precompute.mode=online"])
    with pytest.raises(UserError) as refusal:
        check_fits(cfg, recipe, ["precompute", "train", "eval"])
    message = str(refusal.value)
    total = memory_plan(cfg, recipe)[1].total / GIB
    assert message.startswith(f"train: the memory plan needs {total:.1f} GiB per rank, more than the 79.2 GiB of an "
                              "H100 80 GB; it fits with ") and "\n" not in message
    fixes = re.findall(r"((?:[a-z_.]+=\S+ ?)+) \((\d+\.\d) GiB\)", message)
    assert [f[0].split("=")[0] for f in fixes] == ["train.batch_tokens", "precompute.batch_tokens",
                                                   "precompute.mode"], message
    for overrides, said in fixes:
        fixed = memory_plan(cfg, load_recipe(RECIPE, ["precompute.mode=online", *overrides.split()]))[1]
        assert fixed.fits and f"{fixed.total / GIB:.1f}" == said
    half = load_recipe(RECIPE, ["precompute.mode=online", "train.batch_tokens=8192", "train.grad_accum=4"])
    assert fixes[0][0] == "train.batch_tokens=8192 train.grad_accum=4"  # the first halving fits: the same step
    assert memory_plan(cfg, half)[1].fits
    check_fits(cfg, recipe, ["precompute", "eval"])  # the stages that fit pass


def test_the_dry_run_refuses_the_70b_online_plan_in_one_line(tmp_path, capsys):
    """``mtp-train RECIPE --dry-run`` (in this process: ``cli.main``) on a stand-in for the 70B checkpoint."""
    from mtp_train.cli import main

    stand_in_checkpoint(tmp_path, CONFIG)
    common = [str(RECIPE), f"target.path={tmp_path}", f"data.train={tmp_path / 'data.jsonl'}", "data.format=auto",
              "--dry-run"]
    assert main([*common, "precompute.mode=online"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in ("mtp-train: train: the memory plan needs", "GiB of an H100 80 GB", "precompute.mode=offline (",
                   "train.batch_tokens=8192 train.grad_accum=4 ("):
        assert needle in err, err
    assert main([*common, "head.kind=dflash"]) == 0
    out, _ = capsys.readouterr()
    assert "DOES NOT FIT" not in out and "blocks of 9 at every anchor" in out


def test_training_on_a_gpu_refuses_a_plan_too_large_for_it_before_loading(tmp_path, monkeypatch):
    """On CUDA the train stage plans for this GPU's memory and refuses before anything is read or loaded; on the CPU
    (the plan is of a GPU) it never refuses."""
    from types import SimpleNamespace

    from mtp_train import pipeline

    stand_in_checkpoint(tmp_path, CONFIG)
    recipe = load_recipe(RECIPE, [f"target.path={tmp_path}", "precompute.mode=online"])
    loaded = []
    monkeypatch.setattr("mtp_train.train.trainer.run_train", lambda recipe, tau_probe=None: loaded.append(recipe))
    pipeline.check_gpu_memory(recipe, "train")  # no CUDA here: nothing refused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=H100_BYTES, name="NVIDIA H100 80GB HBM3"))
    with pytest.raises(UserError, match=r"^train: the memory plan needs .* of this GPU \(NVIDIA H100 80GB HBM3\); "
                                        r"it fits with train.batch_tokens=8192"):
        pipeline.STAGE_BY_NAME["train"].run(recipe)
    assert loaded == []
    big = SimpleNamespace(total_memory=141 * GIB, name="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: big)
    pipeline.STAGE_BY_NAME["train"].run(recipe)  # an H200's memory holds it
    assert len(loaded) == 1
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    big.total_memory = H100_BYTES
    pipeline.check_gpu_memory(recipe, "train")  # told to train on the CPU


def test_the_plan_lines_of_the_tiny_recipe_have_no_buffers_in_fp32():
    """A float32 target runs the torch backend (FlashInfer has no float32 kernels): no workspace is planned."""
    recipe = load_recipe(TINY_RECIPE, ["target.dtype=float32"])
    lines = plan_lines(_config(TINY_TARGET / "config.json"), recipe)
    assert not any("buffers" in line for line in lines) and train_activation_bytes(recipe, _config(
        TINY_TARGET / "config.json")) > 0
