"""Damaged or mismatched inputs at every stage: one line naming the file, exit status 2, nothing half-written.

Each test damages a copy of the shared trained run's outputs (``trained_run``: features, the ``mtp`` head and its
checkpoint at step 60) and runs the real command line on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_one_line_user_error, pause_env, paused_processes, resume, run_cli
from mtp_train.errors import UserError
from precompute_helpers import other_target

pytestmark = pytest.mark.slow
SHARD = "shard-00000-00001.safetensors"
STEP = "step-00000060"  # trained_run's last (and only) checkpoint


def copy_run(trained_run: Path, tmp_path: Path, *parts: str) -> Path:
    """A new output directory holding copies of ``parts`` (features, heads, checkpoints) of the trained run."""
    run = tmp_path / "run"
    for part in parts:
        shutil.copytree(trained_run.parent / "run" / part, run / part)
    return run


def damage_shard(shard: Path, how: str) -> None:
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        os.truncate(shard, shard.stat().st_size - 1000)
    else:  # the same size, its header overwritten
        with open(shard, "r+b") as f:
            f.seek(16)
            f.write(b"\xff" * 16)


def verify_hint(run: Path) -> str:
    return f"`mtp-train verify {run / 'features'}`"


# ---- features ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how, problem", [("missing", "missing"), ("truncated", "truncated or replaced"),
                                          ("header", "header does not parse")])
def test_damaged_shard_stops_training_before_the_first_step(trained_run, tmp_path, how, problem):
    run = copy_run(trained_run, tmp_path, "features")
    damage_shard(run / "features" / SHARD, how)
    proc = run_cli("train", trained_run, f"output_dir={run}")
    assert_one_line_user_error(proc, f"{run / 'features' / SHARD}: ", problem, verify_hint(run))
    assert sorted(p.name for p in run.iterdir()) == ["features"]


def test_damaged_manifest_is_one_line(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path, "features")
    manifest = run / "features" / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    proc = run_cli("train", trained_run, f"output_dir={run}")
    assert_one_line_user_error(proc, f"{manifest}: not a features manifest", "rerun precompute with --overwrite")
    assert sorted(p.name for p in run.iterdir()) == ["features"]


def test_damaged_shard_stops_the_eval_before_the_first_step(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path, "features", "heads")
    damage_shard(run / "features" / SHARD, "truncated")
    proc = run_cli("eval", trained_run, f"output_dir={run}")
    assert_one_line_user_error(proc, str(run / "features" / SHARD), verify_hint(run))
    assert not (run / "eval").exists()


def test_shard_damaged_mid_run_stops_training_after_its_last_checkpoint(trained_run, tmp_path):
    """The shards are cut in half while the run is paused after its first checkpoint (the pause hook, at step 2):
    the run stops at its next read, with one line, and the checkpoints it wrote stay whole."""
    run = copy_run(trained_run, tmp_path, "features")
    cmd = [sys.executable, "-m", "mtp_train.cli", "train", str(trained_run), f"output_dir={run}",
           "train.max_steps=400", "train.save_every=2", "train.val_every=400"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=pause_env("train", 2, tmp_path / "paused"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    checkpoints = run / "checkpoints" / "mtp"
    paused = paused_processes(tmp_path / "paused", 1, proc)
    assert (checkpoints / "latest").read_text() == "step-00000002"
    for shard in (run / "features").glob("shard-*.safetensors"):
        os.truncate(shard, shard.stat().st_size // 2)
    resume(paused)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"mtp-train: {run / 'features'}/shard-") and "truncated" in last, last
    assert verify_hint(run) in last
    step = checkpoints / (checkpoints / "latest").read_text()
    assert sorted(p.name for p in step.iterdir()) == ["head.safetensors", "optimizer.rank-00000.pt", "rng.pt",
                                                     "state.json"]
    assert json.loads((step / "state.json").read_text())["step"] == int(step.name.removeprefix("step-")) < 400
    assert not list(checkpoints.glob(".tmp-*")) and not (run / "heads").exists()


def test_shard_damaged_after_the_check_is_one_line_for_every_reader(trained_run, tmp_path):
    """After the start-up check: the trainer's positioned reads and the eval's memory-mapped reads alike."""
    from mtp_train.train.data import load_batch
    from mtp_train.features.reader import FeatureReader

    run = copy_run(trained_run, tmp_path, "features")
    reader = FeatureReader(run / "features")
    refs = [r for r in reader.sequences if r.shard == SHARD]
    load_batch(reader, refs, 4096, torch.float32)  # the shard is open now
    shard = run / "features" / SHARD
    os.truncate(shard, shard.stat().st_size // 2)
    message = f"{re.escape(str(shard))}: file ends at byte .*{re.escape(verify_hint(run))}"
    with pytest.raises(UserError, match=message):
        load_batch(reader, refs, 4096, torch.float32)
    with pytest.raises(UserError, match=message):
        reader.load(refs[0])


# ---- heads ------------------------------------------------------------------------------------------------

def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1000)


@pytest.mark.parametrize("case", ["weights truncated", "config not JSON", "config of something else",
                                  "another target", "comparison head truncated"])
def test_damaged_head_stops_the_eval_before_the_first_step(trained_run, tmp_path, case):
    run = copy_run(trained_run, tmp_path, "features", "heads")
    head = run / "heads" / "mtp"
    args = []
    if case == "weights truncated":
        truncate(head / "model.safetensors")
        needles = [f"{head / 'model.safetensors'}: cannot be read", "mtp-train train"]
    elif case == "config not JSON":
        (head / "config.json").write_text('{"kind": ')
        needles = [f"{head / 'config.json'}: invalid JSON", "mtp-train train"]
    elif case == "config of something else":
        shutil.copy(run / "features" / "manifest.json", head / "config.json")
        needles = [f"{head / 'config.json'}: not a head config"]
    elif case == "another target":
        args = [f"target.path={other_target(tmp_path)}"]
        needles = [f"{head / 'config.json'}: the head was trained for a different target"]
    else:
        shutil.copytree(head, run / "heads" / "eagle")
        truncate(run / "heads" / "eagle" / "model.safetensors")
        args = ["eval.compare=[eagle]"]
        needles = [f"{run / 'heads' / 'eagle' / 'model.safetensors'}: cannot be read"]
    proc = run_cli("eval", trained_run, f"output_dir={run}", *args)
    assert_one_line_user_error(proc, *needles)
    assert not (run / "eval").exists()


def test_train_writes_a_damaged_head_again_from_its_checkpoint(trained_run, tmp_path):
    """The head directory is train's output: a damaged one is not complete, so train writes it again (here from
    the final checkpoint, without a step) rather than skipping."""
    run = copy_run(trained_run, tmp_path, "features", "heads", "checkpoints")
    weights = run / "heads" / "mtp" / "model.safetensors"
    good = weights.read_bytes()
    truncate(weights)
    proc = run_cli("train", trained_run, f"output_dir={run}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming at step 60" in proc.stderr and "skipped" not in proc.stderr
    assert weights.read_bytes() == good


# ---- checkpoints ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["head.safetensors", "rng.pt", "state.json", "optimizer.rank-00000.pt"])
def test_damaged_checkpoint_file_is_one_line_naming_it(trained_run, tmp_path, name):
    run = copy_run(trained_run, tmp_path, "features", "checkpoints")
    file = run / "checkpoints" / "mtp" / STEP / name
    if name == "state.json":
        file.write_text('{"step": ')
    else:
        os.truncate(file, file.stat().st_size // 2)
    proc = run_cli("train", trained_run, f"output_dir={run}")
    assert_one_line_user_error(proc, f"{file}: checkpoint is corrupt or incomplete",
                               f"point {run / 'checkpoints' / 'mtp' / 'latest'} at an older one")
    assert sorted(p.name for p in (run / "checkpoints" / "mtp").iterdir()) == ["latest", STEP]
    assert not (run / "heads").exists()


def test_latest_naming_a_missing_checkpoint_is_one_line(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path, "features", "checkpoints")
    (run / "checkpoints" / "mtp" / "latest").write_text("step-00000099")
    proc = run_cli("train", trained_run, f"output_dir={run}")
    assert_one_line_user_error(proc, f"{run / 'checkpoints' / 'mtp' / 'latest'}: names 'step-00000099'")
    assert not (run / "heads").exists()


# ---- the baseline report ----------------------------------------------------------------------------------

def test_baseline_that_is_not_a_report_stops_the_eval_first(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path, "features", "heads")
    not_json = tmp_path / "old.json"
    not_json.write_text("{not json")
    assert_one_line_user_error(run_cli("eval", trained_run, f"output_dir={run}", "--baseline", not_json),
                               f"--baseline {not_json}: not valid JSON")
    other_json = run / "features" / "manifest.json"
    assert_one_line_user_error(run_cli("eval", trained_run, f"output_dir={run}", f"eval.baseline={other_json}"),
                               f"eval.baseline {other_json}: not a report")
    assert not (run / "eval").exists()
