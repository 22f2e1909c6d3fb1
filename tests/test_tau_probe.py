"""τ while a head trains (``train.tau_every``): the probe decodes speculatively and measures what the eval would,
it leaves the trained head untouched, its records reach the log and the report, and the memory plan counts it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_cli
from mtp_train.eval.metrics import alpha, pooled_tau
from mtp_train.eval.run import request_traces
from mtp_train.eval.sections import training
from mtp_train.eval.training_curve import training_curves
from mtp_train.heads import build_head
from mtp_train.errors import UserError
from mtp_train.memory import check_fits, memory_plan, target_weight_bytes
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe
from mtp_train.runtime.drafters import head_drafter
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.train.checkpoint import load_trained_head
from mtp_train.eval.tau_probe import TauProbe
from test_report import make_report


def test_the_probe_measures_what_speculative_decoding_accepts_and_leaves_the_head_alone(trained_run):
    """The trained head's probe is the τ and α₁ of decoding the probe's prompts speculatively at the recipe's largest
    k; a random head of the same spec accepts less; the head measured keeps its weights and its training mode."""
    recipe = load_recipe(trained_run, ["train.tau_prompts=6", "train.tau_tokens=24"])
    probe = TauProbe.start(recipe, torch.device("cpu"))
    assert len(probe.prompts) == 6 and probe.k == max(recipe.eval.k) == 2
    head = load_trained_head(recipe.head_dir(), recipe.target.path, probe.engine.cfg).train()
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    measured = probe.measure(head)
    assert head.training and all(torch.equal(p, before[n]) for n, p in head.named_parameters())

    copy = load_trained_head(recipe.head_dir(), recipe.target.path, probe.engine.cfg)
    decoder = SpeculativeDecoder(probe.engine, head_drafter(probe.engine, copy), probe.k)
    results = decoder.generate(probe.prompts, SamplingParams(max_new_tokens=24))
    traces = request_traces([type("P", (), {"prompt_id": "p", "category": "c"})] * 6, probe.prompts, results)
    assert measured["tau"] == round(pooled_tau(traces), 4)
    assert measured["alpha1"] == round(alpha(traces, 2)[0][0], 4)

    torch.manual_seed(1)
    untrained = build_head(head.spec)
    assert probe.measure(untrained)["tau"] < measured["tau"] - 0.2


def test_a_run_with_probes_trains_the_same_head_and_logs_tau_against_tokens(trained_run, tmp_path):
    """Six steps with a probe every 3 give the same weights as six without; the log's probes sit at steps 3 and 6,
    each with the tokens of the steps so far; the report reads them from the log."""
    features = trained_run.parent / "run" / "features"
    heads = {}
    for every in (0, 3):
        out = tmp_path / f"every{every}"
        args = [f"output_dir={out}", f"precompute.features_dir={features}", "train.max_steps=6",
                "train.val_every=3", "train.save_every=6", f"train.tau_every={every}", "train.tau_prompts=4",
                "train.tau_tokens=16"]
        proc = run_cli("train", trained_run, *args, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        heads[every] = load_file(out / "heads" / "mtp" / "model.safetensors")
        records = [json.loads(line) for line in (out / "train_log.mtp.jsonl").read_text().splitlines()]
    assert heads[0].keys() == heads[3].keys() and all(torch.equal(heads[0][k], heads[3][k]) for k in heads[0])
    probes = [r for r in records if "tau" in r]
    assert [r["step"] for r in probes] == [3, 6]
    for r in probes:
        assert r["train_tokens"] == sum(x["tokens"] for x in records if x["step"] <= r["step"])
        assert 1.0 <= r["tau"] <= 3.0 and 0.0 <= r["alpha1"] <= 1.0 and r["tau_s"] > 0
    assert "tau" in proc.stderr  # the progress line carries the latest probe

    recipe = load_recipe(trained_run, [f"output_dir={tmp_path / 'every3'}"])
    curves = training_curves(recipe)
    assert [(p.step, p.tau, p.alpha1) for p in curves["mtp"]] == [(r["step"], r["tau"], r["alpha1"]) for r in probes]
    title, blocks = training(make_report(training=curves))
    table = next(b for b in blocks if b[0] == "table")
    assert [row[1] for row in table[2]] == ["3", "6"] and ("img", "training") in blocks


def test_a_torn_log_line_is_skipped_and_a_run_without_probes_says_so(trained_run, tmp_path):
    shutil.copy(trained_run, tmp_path / "recipe.yaml")
    recipe = load_recipe(tmp_path / "recipe.yaml", [f"output_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_log.mtp.jsonl").write_text(
        '{"step": 2, "tokens": 5, "tau": 1.5, "alpha1": 0.4, "train_tokens": 10, "val_top1": [0.3, 0.2]}\n{"step": 3, "ta')
    points = training_curves(recipe)["mtp"]
    assert [(p.step, p.train_tokens, p.val_top1) for p in points] == [(2, 10, 0.3)]
    _, blocks = training(make_report())
    assert blocks[0] == ("p", "No τ probes: the heads trained with train.tau_every 0.")


def test_the_memory_plan_counts_the_probes_target_and_suggests_turning_it_off():
    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b.yaml", ["train.tau_every=100"])
    cfg = ModelConfig.from_hf(json.loads((REPO / "recipes/configs/llama-3.1-8b.json").read_text()))
    train = memory_plan(cfg, recipe)[1]
    assert train.parts["tau probe"] > target_weight_bytes(cfg, 1, 2)
    big = load_recipe(REPO / "recipes" / "llama3.3-70b.yaml", ["train.tau_every=100"])
    big_cfg = ModelConfig.from_hf(json.loads((REPO / "recipes/configs/llama-3.3-70b.json").read_text()))
    assert not memory_plan(big_cfg, big)[1].fits
    with pytest.raises(UserError, match=r"train: the memory plan .* it fits with .*train\.tau_every=0"):
        check_fits(big_cfg, big, ["train"])
