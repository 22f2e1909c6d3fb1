"""The memory plan per rank (``mtp_train.memory``): its parts are the runtime's real sizes, the head's
activations are what autograd saves, and the shipped big recipes carry the plan the code computes."""

from __future__ import annotations

import json
import re

import torch

from conftest import REPO, TINY_RECIPE, TINY_TARGET
from mtp_train.memory import (H100_BYTES, head_activation_bytes_per_token, kv_bytes_per_token, memory_plan,
                              plan_lines, target_weight_bytes)
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe

BIG = [("llama3.1-8b", "llama-3.1-8b"), ("llama3.3-70b", "llama-3.3-70b")]


def _config(path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(path.read_text()))


def test_weight_and_kv_sizes_are_the_runtimes():
    from mtp_train.runtime.engine import Engine

    engine = Engine.from_pretrained(TINY_TARGET, num_pages=10)
    cfg = engine.cfg
    loaded = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert not cfg.tie_word_embeddings  # (a tied lm_head would be one tensor, counted once here)
    assert target_weight_bytes(cfg, 1, 4) == loaded
    pool = engine.kv.k.numel() * 4 + engine.kv.v.numel() * 4
    assert kv_bytes_per_token(cfg, 1, 4) * 10 * engine.allocator.page_size == pool


def test_head_activations_are_what_autograd_saves_on_a_real_forward():
    """The meta-device count equals the same count on a real CPU forward of the tiny target's head."""
    from mtp_train.heads import build_head, head_spec

    recipe = load_recipe(TINY_RECIPE)
    cfg = _config(TINY_TARGET / "config.json")
    per_token = head_activation_bytes_per_token(recipe, cfg)
    head = build_head(head_spec(recipe.head.kind, recipe.head.num_layers, cfg, "x"))
    params = {id(p) for p in head.parameters()}
    saved = 0

    def pack(t):
        nonlocal saved
        if id(t) not in params and id(t._base) not in params:
            saved += t.numel() * t.element_size()
        return t

    tokens = 1024
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = head(torch.randn(tokens, cfg.hidden_size), torch.randn(tokens, cfg.hidden_size),
                   torch.arange(tokens) % 512, [0, 512, 1024])
    out.sum().backward()
    assert saved // tokens == per_token > cfg.hidden_size * 4


def test_the_big_recipes_state_the_plan_the_code_computes_and_fit():
    for name, config in BIG:
        recipe_file = REPO / "recipes" / f"{name}.yaml"
        recipe = load_recipe(recipe_file)
        cfg = _config(REPO / "recipes" / "configs" / f"{config}.json")
        comments = recipe_file.read_text()
        for line in plan_lines(cfg, recipe)[1:]:
            assert f"# {line}\n" in comments, f"{name}.yaml's memory comment is stale: {line}"
        assert all(stage.fits for stage in memory_plan(cfg, recipe)), name


def test_a_batch_too_large_for_the_gpu_is_reported():
    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b.yaml", ["train.batch_tokens=65536", "train.grad_accum=1"])
    cfg = _config(REPO / "recipes" / "configs" / "llama-3.1-8b.json")
    runtime, train = memory_plan(cfg, recipe, H100_BYTES)
    assert runtime.fits and not train.fits
    assert "DOES NOT FIT" in train.line() and train.parts["activations"] > 80 * 2**30


def test_the_dry_run_prints_the_plan(cli):
    proc = cli(TINY_RECIPE, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if re.match(r"\s+(precompute/eval|train)\s", l)]
    assert len(lines) == 2 and all("fits" in l for l in lines)
