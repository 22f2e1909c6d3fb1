"""``train.optimizer``: Muon over the head's hidden matrices and AdamW over the rest, stepped and scheduled as one
optimizer whose state round-trips; refused under DeepSpeed. ``train.lr_schedule``: cosine to 10% or linear to 0.
Fields added later keep the training fingerprints of earlier heads at their old values."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from conftest import TINY_RECIPE, TINY_TARGET, assert_one_line_user_error, run_cli
from mtp_train.features.manifest import text_fingerprint
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.recipe import load_recipe
from mtp_train.train.checkpoint import training_fingerprint
from mtp_train.train.distributed import lr_factor
from mtp_train.train.optimizer import MuonAdamW, build_optimizer, muon_split
from precompute_helpers import make_recipe


@pytest.fixture(scope="module")
def frozen():
    return FrozenTarget.load(TINY_TARGET)


def _head(frozen, seed=0):
    torch.manual_seed(seed)
    return build_head(head_spec("eagle3", 1, frozen.cfg, "x", aux_layers=(1, 2, 3), draft_vocab=512))


def _steps(head, optimizer, n, seed=1):
    """``n`` steps on a fixed random loss of the head's parameters."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = sum((p * torch.randn(p.shape, generator=g)).sum() + p.pow(2).sum() for p in head.parameters())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(frozen):
    head = _head(frozen)
    muon, adamw = muon_split(head)
    names = {id(p): n for n, p in head.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == ["fc.weight", "layers.0.attention.wo.weight",
                                                  "layers.0.attention.wqkv.weight",
                                                  "layers.0.feed_forward.w_down.weight",
                                                  "layers.0.feed_forward.w_gate_up.weight"]
    rest = {names[id(p)] for p in adamw}
    assert "lm_head.weight" in rest and all(p.ndim == 1 or "lm_head" in names[id(p)] for p in adamw)
    assert len(muon) + len(adamw) == len(list(head.parameters()))


def test_one_schedule_sets_both_parts_and_every_matrix_moves(frozen):
    head = _head(frozen)
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    optimizer = build_optimizer(head, "muon", 1e-2, 0.1)
    scheduler = LambdaLR(optimizer, lambda step: 0.5)
    muon, adamw = optimizer.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [g["lr"] for g in muon.param_groups + adamw.param_groups] == [5e-3, 5e-3]
    _steps(head, optimizer, 2)
    scheduler.step()
    assert all(not torch.equal(p, before[n]) for n, p in head.named_parameters()), "every parameter is trained"


def test_its_state_round_trips_through_a_weights_only_file(frozen):
    """Three steps, the state saved as a checkpoint saves it and loaded into a fresh optimizer on a copy of the
    head: two more steps give both the same weights, bit for bit (Muon's momentum and AdamW's moments restored)."""
    head, copy = _head(frozen), _head(frozen)
    optimizer = build_optimizer(head, "muon", 1e-2, 0.0)
    _steps(head, optimizer, 3)
    copy.load_state_dict(head.state_dict())
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    restored = build_optimizer(copy, "muon", 1e-2, 0.0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    _steps(head, optimizer, 2, seed=5)
    _steps(copy, restored, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), copy.parameters()))
    fresh = build_optimizer(_head(frozen), "muon", 1e-2, 0.0)
    assert isinstance(fresh, MuonAdamW) and not fresh.parts[0].state, "the check above restored state that exists"


def test_muon_under_deepspeed_is_refused_in_one_line(tmp_path):
    recipe = make_recipe(tmp_path, tmp_path / "none.jsonl", train={"optimizer": "muon", "engine": "deepspeed"})
    assert_one_line_user_error(run_cli("train", recipe, "--dry-run"), "train", "optimizer muon runs under engine ddp")


def test_the_schedules_share_the_warmup_and_end_at_a_tenth_or_at_zero():
    cosine, linear = lr_factor(4, 20), lr_factor(4, 20, "linear")
    assert [cosine(s) for s in range(4)] == [linear(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(4) == linear(4) == 1.0
    assert linear(12) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.55)
    assert (linear(20), cosine(20)) == (pytest.approx(0.0), pytest.approx(0.1))
    assert all(linear(s) > linear(s + 1) for s in range(4, 20))


@pytest.mark.parametrize("override", ["train.optimizer=muon", "train.lr_schedule=linear", "train.freeze_lm_head=true",
                                      "head.norm_before_fc=true", "head.norm_before_residual=true"])
def test_a_later_field_counts_in_the_fingerprint_only_off_its_old_value(override):
    default = load_recipe(TINY_RECIPE, ["head.kind=eagle3"])
    train = default.train.model_dump(mode="json", exclude={"tau_every", "tau_prompts", "tau_tokens",
                                                             "optimizer", "lr_schedule", "freeze_lm_head"})
    head = default.head.model_dump(mode="json", exclude={"norm_before_fc", "norm_before_residual"})
    before = text_fingerprint(json.dumps({"recipe_train": train, "head": head, "seed": default.seed,
                                          "features": {"f": 1}, "init_from": None}, sort_keys=True))
    assert training_fingerprint(default, {"f": 1}, None) == before  # what a head trained before these fields had
    changed = load_recipe(TINY_RECIPE, ["head.kind=eagle3", override])
    assert training_fingerprint(changed, {"f": 1}, None) != before
