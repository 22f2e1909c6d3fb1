"""``head.init_from``: training starts from a head another run or trainer made (its weights, draft vocabulary, aux
layers and options), checked against the recipe before anything runs, and resumes as any run does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY_RECIPE, TINY_TARGET, assert_one_line_user_error, run_cli
from mtp_train.features.manifest import target_fingerprint
from mtp_train.heads import build_head, head_spec
from mtp_train.models.config import ModelConfig
from mtp_train.train.checkpoint import head_to_hf, load_head, save_head

CFG = ModelConfig.from_hf(yaml.safe_load((TINY_TARGET / "config.json").read_text()))


def _saved_eagle3(root: Path) -> Path:
    torch.manual_seed(0)
    head = build_head(head_spec("eagle3", 1, CFG, target_fingerprint(TINY_TARGET), "native", (2, 3, 4), 1024))
    save_head(root, head, {})
    return root


@pytest.mark.parametrize("overrides, needle", [
    (["head.kind=mtp"], "holds an eagle3 head; set head.kind: eagle3"),
    (["head.kind=eagle3", "head.aux_layers=[1,2,3]"], "set head.aux_layers: [2, 3, 4]"),
    (["head.kind=eagle3", "head.draft_vocab=512"], "head.draft_vocab: 512 is not the head.init_from head's 1024"),
    (["head.kind=eagle3", "head.window=64"], "head.window: 64 is not the head.init_from head's 0"),
])
def test_a_recipe_that_contradicts_its_init_head_is_refused_before_anything_runs(tmp_path, overrides, needle):
    src = _saved_eagle3(tmp_path / "head")
    proc = run_cli(TINY_RECIPE, f"output_dir={tmp_path / 'out'}", f"head.init_from={src}", *overrides, "--dry-run")
    assert_one_line_user_error(proc, needle)
    assert not (tmp_path / "out").exists()


def test_a_recipe_that_agrees_with_its_init_head_plans(tmp_path):
    src = _saved_eagle3(tmp_path / "head")
    proc = run_cli(TINY_RECIPE, f"output_dir={tmp_path / 'out'}", f"head.init_from={src}", "head.kind=eagle3",
                   "head.aux_layers=[2,3,4]", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    missing = run_cli(TINY_RECIPE, f"head.init_from={tmp_path / 'nowhere'}", "--dry-run")
    assert_one_line_user_error(missing, "config.json not found")


def test_training_starts_from_the_init_head(trained_run, tmp_path):
    """A run fine-tunes the trained run's mtp head on the same features at a vanishing learning rate: its head is
    the init head's (to the update's size), not a fresh one; with an ordinary rate it moves away from it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run" / "features", run / "features")
    init = trained_run.parent / "run" / "heads" / "mtp"
    recipe = yaml.safe_load(trained_run.read_text())
    recipe["output_dir"] = str(run)
    recipe["head"] = {"kind": "mtp", "init_from": str(init)}
    recipe["train"].update(max_steps=2, val_every=2, save_every=2, lr=1e-12, warmup_steps=0)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("train", path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, tuned = head_to_hf(load_head(init)), head_to_hf(load_head(run / "heads" / "mtp"))
    assert sorted(start) == sorted(tuned)
    assert all(torch.allclose(start[k], tuned[k], atol=1e-8) for k in start)
    assert any((start[k] - tuned[k]).abs().max() > 0 for k in start), "the steps ran"
