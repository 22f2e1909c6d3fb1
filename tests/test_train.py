"""Heads and trainer: DeepSeek layout, learning, exact resume after SIGKILL, 2-process DDP, frozen parts, errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli
from mtp_train.errors import UserError
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe
from precompute_helpers import make_recipe, other_target, run_precompute_cli, sgd_rows, write_jsonl

TRAIN = {"batch_tokens": 1024, "lr": 3e-3, "warmup_steps": 2, "unroll": 2, "val_every": 4, "save_every": 4,
         "wandb_mode": "disabled"}


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """Features of 80 SGD train dialogues, shared by the training tests (copied per test)."""
    tmp = tmp_path_factory.mktemp("features")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(80, split="train"))
    recipe = make_recipe(tmp, data, data={"heldout_rows": 8}, precompute={"layers": [-1], "topk": 16})
    proc = run_precompute_cli(recipe)
    assert proc.returncode == 0, proc.stderr
    return tmp / "run" / "features", data


def train_recipe(tmp_path, features, **train):
    feats, data = features
    return make_recipe(tmp_path, data, data={"heldout_rows": 8},
                       precompute={"layers": [-1], "topk": 16, "features_dir": str(feats)}, train={**TRAIN, **train})


def run_train_cli(recipe, *overrides, crash_at=None, launcher=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "MTP_TRAIN_CRASH_AT"}
    if crash_at:
        env["MTP_TRAIN_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "mtp_train.cli", "train", str(recipe), *overrides]
    if launcher == "deepspeed":  # ZeRO-2 over gloo on 2 CPU processes
        precision = "bf16" if "train.mixed_precision=bf16" in overrides else "no"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "2",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", precision, "--dynamo_backend", "no",
               "-m", "mtp_train.cli", "train", str(recipe), "train.engine=deepspeed", "train.zero_stage=2", *overrides]
    elif launcher:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(launcher),
               "-m", "mtp_train.cli", "train", str(recipe), *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def log(tmp_path, kind="mtp"):
    return [json.loads(line) for line in (tmp_path / "run" / f"train_log.{kind}.jsonl").read_text().splitlines()]


def test_deepseek_mtp_layout_and_forward_match_an_independent_reference():
    cfg = ModelConfig("llama", 64, 32, 48, 2, 4, 2, 8, 1e-6, 128)
    torch.manual_seed(0)
    head = build_head(head_spec("mtp", 1, cfg, "fp"))
    from mtp_train.train.checkpoint import head_to_hf

    hf = head_to_hf(head)
    expected = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"} | {
        f"layers.0.{n}" for n in ["input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight"]}
    assert set(hf) == expected
    with torch.no_grad():
        for name, p in head.named_parameters():  # non-trivial norms
            if "norm" in name:
                p.normal_(1.0, 0.2)
        hf = head_to_hf(head)

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def reference(emb, h, pos):
        """Written from the DeepSeek-V3 description, independently of the runtime's modules."""
        x = torch.cat([rms(emb, hf["enorm.weight"]), rms(h, hf["hnorm.weight"])], -1) @ hf["eh_proj.weight"].T
        p = "layers.0."
        a = rms(x, hf[p + "input_layernorm.weight"])
        q = (a @ hf[p + "self_attn.q_proj.weight"].T).view(-1, 4, 8)
        k = (a @ hf[p + "self_attn.k_proj.weight"].T).view(-1, 2, 8)
        v = (a @ hf[p + "self_attn.v_proj.weight"].T).view(-1, 2, 8)
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rot = lambda t: torch.cat([-t[..., 4:], t[..., :4]], -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / 8**0.5
        s = s.masked_fill(torch.ones(len(x), len(x)).triu(1).bool(), float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", s, v).reshape(len(x), 32) @ hf[p + "self_attn.o_proj.weight"].T
        x = x + o
        m = rms(x, hf[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(m @ hf[p + "mlp.gate_proj.weight"].T) * (m @ hf[p + "mlp.up_proj.weight"].T)
        x = x + g @ hf[p + "mlp.down_proj.weight"].T
        return rms(x, hf["shared_head.norm.weight"])

    emb, h = torch.randn(7, 32), torch.randn(7, 32)
    pos = torch.arange(1, 8)  # no document start: the position-0 embedding rule is tested below
    with torch.no_grad():
        ours = head.lm_head_input(head(emb, h, pos, [0, 7]))
        assert (ours - reference(emb, h, pos)).abs().max() < 1e-5
        zeroed = head(emb, h, torch.arange(7), [0, 7])
        emb0 = emb.clone()
        emb0[0] = 0
        assert torch.allclose(zeroed, head(emb0, h, torch.arange(7) + 0, [0, 7]))


def test_eagle_head_has_fc_and_no_input_or_final_norm():
    from mtp_train.train.checkpoint import head_to_hf

    cfg = ModelConfig("llama", 64, 32, 48, 1, 4, 2, 8, 1e-6, 128)
    names = set(head_to_hf(build_head(head_spec("eagle", 1, cfg, "fp"))))
    assert "fc.weight" in names and "layers.0.post_attention_layernorm.weight" in names
    assert not any("input_layernorm" in n or "shared_head" in n or "enorm" in n for n in names)


@pytest.mark.slow
def test_both_heads_learn_and_mtp_beats_a_bigram_baseline(tmp_path, features):
    results = {}
    for kind in ("mtp", "eagle"):
        recipe = train_recipe(tmp_path, features, max_steps=30, unroll=1)
        proc = run_train_cli(recipe, f"head.kind={kind}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses = [r["loss"] for r in log(tmp_path, kind)]
        assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3, (kind, losses)
        results[kind] = json.loads((tmp_path / "run" / "heads" / kind / "config.json").read_text())["validation"]
    # Bigram baseline: predict the target's next token from the current label token alone, fit on train.
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features[0])
    counts = {}
    for ref in reader.train:
        t = reader.load(ref)
        ids, top = t["input_ids"].tolist(), t["topk_ids"][:, 0].tolist()
        for i in range(len(ids) - 2):
            counts.setdefault(ids[i + 1], {}).setdefault(top[i + 1], 0)
            counts[ids[i + 1]][top[i + 1]] += 1
    right = total = 0
    for ref in reader.heldout:
        t = reader.load(ref)
        ids, top, mask = t["input_ids"].tolist(), t["topk_ids"][:, 0].tolist(), t["loss_mask"].tolist()
        for i in range(len(ids) - 2):
            if mask[i + 2]:
                guess = max(counts.get(ids[i + 1], {-1: 1}).items(), key=lambda kv: kv[1])[0]
                right += guess == top[i + 1]
                total += 1
    bigram = right / total
    assert results["mtp"]["val_top1"][0] > bigram + 0.05, (results, bigram)


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_is_exact(tmp_path, features):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()
    ref = run_train_cli(train_recipe(ref_dir, features, max_steps=12))
    assert ref.returncode == 0, ref.stderr[-2000:]
    recipe = train_recipe(run_dir, features, max_steps=12)
    killed = run_train_cli(recipe, crash_at="train:4")
    assert killed.returncode == -signal.SIGKILL
    assert (run_dir / "run" / "checkpoints" / "mtp" / "latest").read_text() == "step-00000004"
    with open(run_dir / "run" / "train_log.mtp.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a kill in the middle of writing a log line
    resumed = run_train_cli(recipe)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 4" in resumed.stderr
    assert [r["loss"] for r in log(run_dir)] == [r["loss"] for r in log(ref_dir)]
    a = load_file(run_dir / "run" / "heads" / "mtp" / "model.safetensors")
    b = load_file(ref_dir / "run" / "heads" / "mtp" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(list((run_dir / "run" / "checkpoints" / "mtp").glob("step-*"))) == 2, "rotation keeps 2"


@pytest.mark.slow
def test_two_processes_keep_identical_weights_and_match_one_process(tmp_path, features):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    single = run_train_cli(train_recipe(one, features, max_steps=6, grad_accum=2))
    assert single.returncode == 0, single.stderr[-2000:]
    ddp = run_train_cli(train_recipe(two, features, max_steps=6), launcher=2)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "2 process(es)" in ddp.stderr
    config = json.loads((two / "run" / "heads" / "mtp" / "config.json").read_text())
    digests = config["rank_weight_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]
    for a, b in zip(log(one), log(two)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


@pytest.mark.slow
def test_one_deepspeed_process_trains_the_recipes_head_and_its_comparison_head(tmp_path, features):
    """``mtp-train train`` without a launcher, under DeepSpeed, trains the recipe's head and then the ``eval.compare``
    head in the same process: the second gets its own accelerator (accelerate refuses a second DeepSpeed plugin
    in a process unless its state is reset)."""
    recipe = train_recipe(tmp_path, features, max_steps=2, val_every=2, save_every=2)
    proc = run_train_cli(recipe, "train.engine=deepspeed", "eval.compare=[eagle]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in ("mtp", "eagle"):
        assert (tmp_path / "run" / "heads" / kind / "model.safetensors").is_file(), kind


def test_deepspeed_zero2_checkpoints_every_rank_and_resumes_exactly(tmp_path, features):
    """Under ZeRO the optimizer state is partitioned: each rank saves and restores its own part."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "resumed"
    ref_dir.mkdir()
    run_dir.mkdir()
    ref = run_train_cli(train_recipe(ref_dir, features, max_steps=4, save_every=2, grad_accum=2), launcher="deepspeed")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "2 process(es)" in ref.stderr
    step2 = ref_dir / "run" / "checkpoints" / "mtp" / "step-00000002"
    shards = [torch.load(step2 / f"optimizer.rank-{r:05d}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(shards[0]["fp32"][0], shards[1]["fp32"][0]), "each rank holds its own partition"
    # Resume a second run from the reference's step-2 checkpoint: steps 3-4 and the weights must be identical.
    ckpts = run_dir / "run" / "checkpoints" / "mtp"
    ckpts.mkdir(parents=True)
    shutil.copytree(step2, ckpts / step2.name)
    (ckpts / "latest").write_text(step2.name)
    resumed = run_train_cli(train_recipe(run_dir, features, max_steps=4, save_every=2, grad_accum=2),
                            launcher="deepspeed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 2" in resumed.stderr
    assert [r["loss"] for r in log(run_dir)] == [r["loss"] for r in log(ref_dir)][2:]
    a = load_file(run_dir / "run" / "heads" / "mtp" / "model.safetensors")
    b = load_file(ref_dir / "run" / "heads" / "mtp" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Resuming a ZeRO checkpoint with another number of ranks, or without ZeRO, is refused in one line.
    (ckpts / "latest").write_text(step2.name)
    shutil.rmtree(run_dir / "run" / "heads")
    recipe = train_recipe(run_dir, features, max_steps=4, save_every=2, grad_accum=2)
    single = run_train_cli(recipe, "train.engine=deepspeed")
    assert single.returncode == 2 and "resume with 2 process(es)" in single.stderr.strip().splitlines()[-1]
    ddp = run_train_cli(recipe)
    assert ddp.returncode == 2 and "train.engine=deepspeed" in ddp.stderr.strip().splitlines()[-1]


def test_frozen_parts_are_read_selectively_and_stay_unchanged(tmp_path, features):
    recipe = train_recipe(tmp_path, features, max_steps=3, unroll=1)
    frozen = FrozenTarget.load(TINY_TARGET)
    before = {k: v.clone() for k, v in frozen.state_dict().items()}
    assert set(before) == {"embed_weight", "norm_weight", "lm_head_weight"}
    from mtp_train.train.trainer import run_train

    out = run_train(load_recipe(recipe))
    head_tensors = load_file(out / "model.safetensors")
    assert not any("embed" in k or "lm_head" in k for k in head_tensors)
    target = load_file(TINY_TARGET / "model.safetensors")
    assert torch.equal(target["model.embed_tokens.weight"], before["embed_weight"])
    assert torch.equal(target["lm_head.weight"], before["lm_head_weight"])
    from mtp_train.train.checkpoint import load_head

    loaded = load_head(out)
    assert loaded.spec.target.rope == frozen.cfg.rope and loaded.spec.target.max_positions == 2048


def test_features_from_another_target_are_a_one_line_error(tmp_path, features):
    other = other_target(tmp_path)
    recipe = train_recipe(tmp_path, features, max_steps=2)
    proc = run_train_cli(recipe, f"target.path={other}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "different target" in proc.stderr.strip().splitlines()[-1]


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, features):
    recipe = train_recipe(tmp_path, features, max_steps=4, save_every=2)
    assert run_train_cli(recipe, "train.max_steps=2").returncode == 0
    ckpt = tmp_path / "run" / "checkpoints" / "mtp" / "step-00000002" / "optimizer.rank-00000.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:50])
    proc = run_train_cli(recipe)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "checkpoint is corrupt" in proc.stderr and "step-00000002" in proc.stderr


@pytest.mark.slow
def test_muon_resumes_its_own_state_and_a_checkpoint_of_another_optimizer_is_refused(tmp_path, features):
    """``train.optimizer: muon`` trains, resumes from its checkpoint to the uninterrupted run's losses (its state dict
    holds both parts), and a checkpoint of the other optimizer is refused in one line naming both."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    for d in (ref_dir, run_dir):
        d.mkdir()
    assert run_train_cli(train_recipe(ref_dir, features, max_steps=8), "train.optimizer=muon").returncode == 0
    recipe = train_recipe(run_dir, features, max_steps=8)
    assert run_train_cli(recipe, "train.optimizer=muon", "train.max_steps=4").returncode == 0
    assert_one_line_user_error(run_train_cli(recipe), "step-00000004", "holds muon's state",
                               "train.optimizer adamw", "resume with train.optimizer=muon")
    resumed = run_train_cli(recipe, "train.optimizer=muon")
    assert resumed.returncode == 0 and "resuming at step 4" in resumed.stderr, resumed.stderr[-2000:]
    losses = [r["loss"] for r in log(ref_dir)]
    assert [r["loss"] for r in log(run_dir)] == losses and losses[-1] < losses[0]


def test_head_config_with_another_hidden_size_is_refused(tmp_path):
    from mtp_train.heads import load_head_config
    from mtp_train.train.checkpoint import head_from_hf, head_to_hf

    cfg = ModelConfig("llama", 64, 32, 48, 1, 4, 2, 8, 1e-6, 128)
    spec = head_spec("mtp", 1, cfg, "fp")
    wrong = head_to_hf(build_head(head_spec("mtp", 1, ModelConfig("llama", 64, 48, 48, 1, 4, 2, 12, 1e-6, 128), "fp")))
    with pytest.raises(UserError, match="do not fit the head's config"):
        head_from_hf(spec, wrong, "x/model.safetensors")
    from mtp_train.train.checkpoint import load_head, save_head

    save_head(tmp_path / "head", build_head(spec), {})
    tiny = FrozenTarget.load(TINY_TARGET).cfg
    with pytest.raises(UserError, match="hidden size 32 .* the target has 128"):
        load_head(tmp_path / "head", tiny)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not a head config"):
        load_head_config(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [2, "deepspeed"])
def test_bf16_trains_under_ddp_and_deepspeed_and_writes_its_head(tmp_path, features, launcher):
    """``train.mixed_precision: bf16`` on 2 CPU processes (bf16 works on CPU): DDP keeps fp32 weights under bf16
    autocast; DeepSpeed's bf16 engine holds a bf16 head beside fp32 features and frozen parts, and writes it."""
    recipe = train_recipe(tmp_path, features, max_steps=4, save_every=2)
    proc = run_train_cli(recipe, "train.mixed_precision=bf16", launcher=launcher)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    head = tmp_path / "run" / "heads" / "mtp"
    config = json.loads((head / "config.json").read_text())
    digests = config["rank_weight_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1], "the replicas stayed identical"
    losses = config["validation"]["val_loss"]
    assert all(0 < loss < 20 for loss in losses), losses
    weights = load_file(head / "model.safetensors")
    dtypes = {t.dtype for t in weights.values()}
    assert dtypes == ({torch.bfloat16} if launcher == "deepspeed" else {torch.float32}), dtypes
