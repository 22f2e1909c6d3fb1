"""The eval stage: a lossless report with validation through the runtime, baselines, draft-target, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import run_cli
from hf_models import save_random_model
from mtp_train.eval.plots import PLOTS
from mtp_train.runtime.machine import cpu_model

pytestmark = pytest.mark.slow


def report(recipe):
    return json.loads((recipe.parent / "run" / "eval" / "report.json").read_text())


def test_eval_writes_a_lossless_report_whose_validation_matches_the_trainer(trained_run):
    proc = run_cli("eval", trained_run, "eval.compare=[bigram]", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = report(trained_run)
    for key in ("tau", "alpha", "k", "temperature", "lossless", "val_loss", "val_acc", "draft_cost_ratio",
                "expected_speedup", "measured_speedup", "distinct2", "by_category", "settings", "versions"):
        assert key in r
    assert r["lossless"] is True and r["mode"] == "mtp"
    assert cpu_model()[0] in r["device"], "the report names the CPU its speeds were measured on"
    assert [p["k"] for p in r["sweep"]] == [1, 2] and all(p["lossless"] for p in r["sweep"])
    assert r["tau"] > 1.0, "a trained head gets some drafts accepted"
    for p in r["sweep"]:  # the expected speedup composes the measured costs of a step's verify (v) and drafts (c)
        assert p["verify_cost_ratio"] > 0 and p["cost"]["spec_steps"] > 0
        assert p["expected_speedup"] == pytest.approx(
            p["tau"] / (p["verify_cost_ratio"] + p["k"] * p["draft_cost_ratio"]), rel=1e-3)
    # The runtime's validation (its target and paged head) against the trainer's numbers on the same rows.
    assert not r["val_mismatch"]
    for ours, theirs in zip(r["val_loss"], r["trainer_val_loss"]):
        assert ours == pytest.approx(theirs, rel=0.01)
    for ours, theirs in zip(r["val_acc"], r["trainer_val_acc"]):
        assert ours == pytest.approx(theirs, abs=0.01)
    assert [c["name"] for c in r["comparisons"]] == ["bigram"]
    for sweep in [r["sweep"]] + [c["sweep"] for c in r["comparisons"]]:  # c by context length, every draft
        for p in sweep:
            assert p["by_length"] and all(g["draft_cost_ratio"] > 0 for g in p["by_length"].values())
    html = (trained_run.parent / "run" / "eval" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(PLOTS)
    # A second run finds the report complete and skips.
    again = run_cli("eval", trained_run, "eval.compare=[bigram]", timeout=600)
    assert again.returncode == 0 and "skipped" in again.stderr


def test_report_with_a_baseline_flags_a_regression(trained_run, tmp_path):
    if not (trained_run.parent / "run" / "eval" / "report.json").is_file():
        assert run_cli("eval", trained_run, timeout=600).returncode == 0
    old = report(trained_run)
    old["tau"] *= 1.5  # the previous release looked better
    baseline = tmp_path / "old.json"
    baseline.write_text(json.dumps(old))
    proc = run_cli("report", trained_run, "--baseline", baseline)
    assert proc.returncode == 0, proc.stderr
    r = report(trained_run)
    assert any("tau" in line for line in r["baseline"]["regressions"])
    assert "REGRESSION" in (trained_run.parent / "run" / "eval" / "report.md").read_text()
    baseline.write_text("{not json")
    bad = run_cli("report", trained_run, "--baseline", baseline)
    assert bad.returncode == 2 and "old.json" in bad.stderr and "Traceback" not in bad.stderr


def test_runtime_validation_equals_the_trainer_module(trained_run):
    """Same held-out rows: the trainer's validate() on stored features vs the runtime's target and paged head."""
    from mtp_train.eval.validation import runtime_validation
    from mtp_train.heads.frozen import FrozenTarget
    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.drafters import HeadDrafter
    from mtp_train.train.checkpoint import load_head
    from mtp_train.train.objective import heldout_batches, loss_weights, validate
    from mtp_train.features.reader import FeatureReader

    recipe = load_recipe(trained_run)
    reader = FeatureReader(recipe.features_dir, target=recipe.target.path)
    head = load_head(recipe.output_dir / "heads" / "mtp")
    weights = loss_weights(recipe)
    with torch.no_grad():
        trainer = validate(head, FrozenTarget.load(recipe.target.path), heldout_batches(reader, 2048), weights)
    engine = Engine.from_pretrained(recipe.target.path)
    runtime = runtime_validation(engine, HeadDrafter(engine, head), reader, weights)
    assert runtime["val_tokens"] == trainer["val_tokens"] > 0
    for a, b in zip(runtime["val_loss"], trainer["val_loss"]):
        assert a == pytest.approx(b, rel=0.01)  # bf16 stored features vs the runtime's fp32 hidden states
    for a, b in zip(runtime["val_top1"], trainer["val_top1"]):
        assert a == pytest.approx(b, abs=0.01)


def test_draft_target_eval_with_a_draft_model(trained_run, tmp_path):
    draft = tmp_path / "draft"
    save_random_model("qwen2", draft, vocab_size=4096, hidden_size=64, num_hidden_layers=1, max_position_embeddings=2048)
    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run" / "features", run / "features")
    proc = run_cli("eval", trained_run, f"eval.draft_model={draft}", f"output_dir={run}", "eval.k=[2]", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((run / "eval" / "report.json").read_text())
    assert r["mode"] == "draft_target" and r["lossless"] is True
    assert r["val_loss"] == [] and not r["val_mismatch"]


def test_eval_without_a_trained_head_is_a_one_line_error(trained_run, tmp_path):
    proc = run_cli("eval", trained_run, f"output_dir={tmp_path / 'empty'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no trained head" in proc.stderr.strip().splitlines()[-1]


def test_a_second_eval_with_other_settings_keeps_the_first(trained_run, tmp_path):
    """Text samples at T = 0 are identical to plain decoding; a T = 1 only eval is lossless n/a; the first report
    is kept beside the second, not replaced."""
    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run" / "features", run / "features")
    shutil.copytree(trained_run.parent / "run" / "heads", run / "heads")
    first = run_cli("eval", trained_run, f"output_dir={run}", "eval.k=[1]", timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    r1 = json.loads((run / "eval" / "report.json").read_text())
    assert r1["lossless"] is True
    assert [(s["prompt_set"], s["identical_to_plain"]) for s in r1["samples"]] == [("heldout", True)] * 2
    assert all(s["reply"] and s["prompt"].startswith("[") for s in r1["samples"])
    second = run_cli("eval", trained_run, f"output_dir={run}", "eval.k=[1]", "eval.temperatures=[1.0]", timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    r2 = json.loads((run / "eval" / "report.json").read_text())
    assert r2["lossless"] is None and [p["lossless"] for p in r2["sweep"]] == [None]
    assert [s["identical_to_plain"] for s in r2["samples"]] == [None, None]
    assert "Lossless: n/a" in (run / "eval" / "report.md").read_text()
    (kept,) = (run / "eval" / "previous").iterdir()
    assert json.loads((kept / "report.json").read_text()) == r1
    assert sorted(p.name for p in kept.iterdir()) == ["model_card.md", "report.html", "report.json", "report.md"]
    assert f"kept in {kept}" in second.stderr


def test_an_eval_sweeps_trees_beside_the_chains(trained_run, tmp_path):
    """eval.trees: each tree is decoded at every temperature, checked lossless at T = 0, and tabled beside the chain
    of k = its depth with SGLang's accept length; v comes from forwards timed alone (the plain decode step with its
    one-token forward widened to the verify's), so the expected speedup is a prediction whose gap the cost section
    accounts for at every point."""
    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run" / "features", run / "features")
    shutil.copytree(trained_run.parent / "run" / "heads", run / "heads")
    proc = run_cli("eval", trained_run, f"output_dir={run}", "eval.k=[2]",
                   "eval.trees=[{topk: 3, depth: 2, draft_tokens: 5}]", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "eval" / "report.json").read_text())
    (tree,) = report["tree_sweep"]
    assert tree["tree"] == {"topk": 3, "depth": 2, "draft_tokens": 5} and tree["k"] == 2
    assert tree["lossless"] is True and report["lossless"] is True
    assert tree["engine_acceptance"]["mean_acceptance_length"] >= 1
    for point in (tree, report["sweep"][0]):
        cost = point["cost"]
        assert cost["verify_forward_ms"] > 0 and cost["decode_forward_ms"] > 0 and cost["spec_wall_s"] > 0
        assert cost["decode_batch_steps"], "the probe's batch sizes: those of the plain run's decode steps"
        step = cost["plain_decode_step_ms"]  # v in plain decode steps, as c is
        assert point["verify_cost_ratio"] == pytest.approx(
            (step - cost["decode_forward_ms"] + cost["verify_forward_ms"]) / step, abs=1e-3)
    md = (run / "eval" / "report.md").read_text()
    assert "## Draft trees against chains" in md and "| mtp | topk 3, depth 2, 5 tokens | 0 |" in md
    assert "best draft tree (eval.trees)" in md and "Expected / measured − 1 at the " in md


def test_eval_under_tensor_parallelism_equals_tp1(trained_run, tmp_path):
    """torchrun with target.tp=2 (gloo): the target is sharded, the head drafts on the leader, same report."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    if not (trained_run.parent / "run" / "eval" / "report.json").is_file():
        assert run_cli("eval", trained_run, timeout=600).returncode == 0
    tp1 = report(trained_run)
    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run" / "features", run / "features")
    shutil.copytree(trained_run.parent / "run" / "heads", run / "heads")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "mtp_train.cli", "eval", str(trained_run), f"output_dir={run}", "target.tp=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ACCELERATE_USE_CPU": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads((run / "eval" / "report.json").read_text())
    assert tp2["lossless"] is True
    assert [(p["k"], p["tau"], p["alpha"]) for p in tp2["sweep"]] == [(p["k"], p["tau"], p["alpha"]) for p in tp1["sweep"]]
    for a, b in zip(tp2["val_loss"], tp1["val_loss"]):
        assert a == pytest.approx(b, rel=1e-3)
