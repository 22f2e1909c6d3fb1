"""Online training (``precompute.mode: online``): the plan stores nothing; its batches, losses and gradients equal
offline's bit for bit in fp32 (bf16 and fp8 features); a killed online run resumes exactly; DDP ranks score their
own shards and a TP group scores together; the eval runs end to end with 0 bytes of features; bad input is refused
in one line."""

from __future__ import annotations

import gzip
import json
import re
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_one_line_user_error, run_cli
from mtp_train.errors import UserError
from mtp_train.features.online import OnlineFeatures, open_features
from mtp_train.features.reader import FeatureReader
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.tp import TensorParallel
from mtp_train.recipe import load_recipe
from mtp_train.runtime.engine import Engine
from mtp_train.train.data import load_batch, plan_batches
from mtp_train.train.objective import heldout_batches, loss_weights, objective
from mtp_train.train.online import scorer
from precompute_helpers import make_recipe, run_precompute_cli, sgd_rows, write_jsonl
from test_train import TRAIN, run_train_cli

PRECOMPUTE = {"layers": [1, -1], "topk": 16, "shard_tokens": 1000, "batch_tokens": 2048}
FIELDS = ("tokens", "hidden", "loss_mask", "topk_logprobs", "topk_ids", "tail_logprob", "aux")


def log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.mtp.jsonl").read_text().splitlines()]


def elsewhere(recipe, out) -> list[str]:
    """Overrides that train ``recipe``'s features into ``out``."""
    return [f"output_dir={out}", f"precompute.features_dir={load_recipe(recipe).features_dir}"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """80 SGD dialogues precomputed offline and planned online, in bf16 and in fp8: recipe paths by (mode, dtype)."""
    tmp = tmp_path_factory.mktemp("online")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(80, split="train"))
    recipes = {}
    for mode in ("offline", "online"):
        for dtype in ("bf16", "fp8"):
            root = tmp / f"{mode}-{dtype}"
            root.mkdir()
            recipe = make_recipe(root, data, data={"heldout_rows": 8}, train=TRAIN,
                                 precompute={**PRECOMPUTE, "mode": mode, "hidden_dtype": dtype})
            proc = run_precompute_cli(recipe)
            assert proc.returncode == 0, proc.stderr
            recipes[mode, dtype] = recipe
    return recipes


def bound(recipe_path) -> OnlineFeatures:
    """An online plan bound to the runtime's target, as the trainer binds it."""
    recipe = load_recipe(recipe_path)
    features = open_features(recipe)
    assert isinstance(features, OnlineFeatures)
    engine = Engine.for_target(recipe.target, torch.float32, torch.device("cpu"), TensorParallel(),
                               max_batch_tokens=recipe.precompute.batch_tokens)
    features.bind(scorer(engine, features))
    return features


def test_an_online_plan_stores_no_features_and_verifies(plans):
    for dtype in ("bf16", "fp8"):
        features = load_recipe(plans["online", dtype]).features_dir
        manifest = json.loads((features / "manifest.json").read_text())
        assert manifest["online"] and manifest["complete"] and manifest["totals"]["bytes"] == 0
        assert manifest["totals"]["tokens"] > 0 and len(manifest["shards"]) > 8
        assert not list(features.glob("shard-*")), "an online plan writes no shard"
        proc = run_cli("verify", features)
        assert proc.returncode == 0 and "planned for online training, nothing stored" in proc.stdout, proc.stderr
    offline = json.loads((load_recipe(plans["offline", "bf16"]).features_dir / "manifest.json").read_text())
    assert not offline["online"] and "mode" not in offline["settings"] and "hidden_dtype" not in offline["settings"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_online_batches_losses_and_gradients_equal_offline_bit_for_bit(plans, dtype):
    offline = open_features(load_recipe(plans["offline", dtype]))
    online = bound(plans["online", dtype])
    assert isinstance(offline, FeatureReader)
    assert online.train.num_tokens == offline.train.num_tokens and len(online.heldout) == len(offline.heldout)
    recipe = load_recipe(plans["online", dtype])
    frozen = FrozenTarget.load(recipe.target.path)
    weights = loss_weights(recipe)  # TRAIN: 2 unrolled steps
    plan = plan_batches(offline.train, 1024, seed=0, epoch=0)
    for b in (0, 1, len(plan) - 1):
        batches = [load_batch(f, [f.train[i] for i in plan[b]], 1024, torch.float32, aux=(0,)) for f in (offline, online)]
        for name in FIELDS:
            assert torch.equal(getattr(batches[0], name), getattr(batches[1], name)), (b, name)
        grads = []
        for batch in batches:
            torch.manual_seed(0)
            head = build_head(head_spec("mtp", 1, frozen.cfg, "fp"))
            loss, _ = objective(head, frozen, batch, weights)
            loss.backward()
            grads.append((loss.detach(), [p.grad for p in head.parameters()]))
        assert torch.equal(grads[0][0], grads[1][0]), b
        assert all(torch.equal(a, c) for a, c in zip(grads[0][1], grads[1][1])), b
    # the held-out rows, scored once together, read back as offline stored them (the runtime is batch-invariant)
    for a, c in zip(heldout_batches(offline, 1024), heldout_batches(online, 1024)):
        assert all(torch.equal(getattr(a, n), getattr(c, n)) for n in FIELDS if n != "aux")
    assert online.scored >= 2 and online.held_bytes > 0


def start_scoring(recipe, rank: int, world: int):
    """``OnlineScoring`` as training rank ``rank`` of ``world`` starts it (TP 1, on the CPU)."""
    from types import SimpleNamespace

    from mtp_train.train.online import OnlineScoring

    features = open_features(recipe)
    t = recipe.train
    per_epoch = len(plan_batches(features.train, t.batch_tokens, recipe.seed, 0)) // (world * t.grad_accum)
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=world, process_index=rank,
                                  is_main_process=rank == 0)
    return OnlineScoring.start(recipe, features, accelerator, per_epoch)


def _dialogue(raw: dict) -> tuple[str, ...]:
    return tuple(turn["value"] for turn in raw["conversations"])


class ZeroTarget:
    """Stands in for the target where only the rows matter: ``score`` gives zeros of the features' shapes."""

    hidden_size = 128  # the tiny target's

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> ZeroTarget:
        return cls()

    def score(self, sequences, layers=(-1,), topk=0, store_hidden=None):
        from mtp_train.runtime.engine import ScoreOutput

        t = sum(map(len, sequences))
        cu = torch.tensor([0, *np.cumsum([len(s) for s in sequences])], dtype=torch.int64)
        hidden, scale = torch.zeros(t, len(layers), self.hidden_size), None
        if store_hidden is not None:
            hidden, scale = store_hidden(hidden)
        return ScoreOutput(cu, hidden, torch.zeros(t, topk), torch.zeros(t, topk, dtype=torch.long), torch.zeros(t),
                           torch.zeros(t), list(layers), scale)


def test_each_training_rank_converts_only_the_rows_of_the_shards_it_scores(plans, monkeypatch):
    """Two training ranks: each converts the data rows of the shards its own windows hold (those it scores, and
    the next window it encodes ahead) and the held-out rows it validates on, no other; the rows of the two ranks'
    windows are every training row, once."""
    from mtp_train.data import dataset, formats

    recipe = load_recipe(plans["online", "bf16"])
    row_of = {_dialogue(raw): i for i, raw in enumerate(sgd_rows(80, split="train"))}
    converted: list[int] = []
    to_messages = formats.to_messages
    count = lambda raw, fmt: converted.append(row_of[_dialogue(raw)]) or to_messages(raw, fmt)  # noqa: E731
    for module in (dataset, formats):
        monkeypatch.setattr(module, "to_messages", count)
    monkeypatch.setattr("mtp_train.train.online.Engine", ZeroTarget)
    scored = {}
    for rank in (0, 1):
        converted.clear()
        scoring = start_scoring(recipe, rank, 2)
        for step in range(scoring.per_epoch):
            scoring.ensure(step)
        scoring.features.close()
        features = scoring.features
        table = features.sequences

        def rows_of(shards) -> set[int]:
            ids = [table.names.index(s) for s in shards]
            return set(table.row_id[np.isin(table.shard, ids)].tolist())

        heldout = set(features.heldout.row_id.tolist())
        windows = rows_of({s for step in range(scoring.per_epoch) for s in scoring.needed(step)}) - heldout
        ahead = rows_of({s for lanes in scoring.plans[0] for plan in lanes for names in plan.ahead for s in names})
        ahead -= heldout
        assert heldout <= set(converted) and windows <= set(converted), rank
        assert set(converted) - heldout <= ahead, f"rank {rank} converted rows of other ranks' shards"
        scored[rank] = windows
    assert not scored[0] & scored[1]
    assert scored[0] | scored[1] == set(features.train.row_id.tolist())


def test_shards_are_encoded_ahead_on_a_thread_and_quantized_inside_score(plans, monkeypatch):
    """The step path only scores: the rows of a later window's shards are encoded on the encoding thread (asked for
    a window ahead, while earlier steps train), and fp8's quantization runs inside ``Engine.score``, on each batch
    where it was computed, never on the host's copy of a whole shard."""
    import threading

    from mtp_train.features import tensors
    from mtp_train.features.online import PlannedRows

    encoded: dict[int, str] = {}  # a shard's first row -> the thread that encoded it
    encode = PlannedRows.encode

    def encode_where(self, row_ids):
        encoded.setdefault(row_ids[0], threading.current_thread().name)
        return encode(self, row_ids)

    inside, quantized = threading.local(), []
    score, quantize = Engine.score, tensors.quantize_fp8

    def score_inside(self, *args, **kwargs):
        inside.flag = True
        try:
            return score(self, *args, **kwargs)
        finally:
            inside.flag = False

    monkeypatch.setattr(PlannedRows, "encode", encode_where)
    monkeypatch.setattr(Engine, "score", score_inside)
    monkeypatch.setattr(tensors, "quantize_fp8",
                        lambda h: quantized.append(getattr(inside, "flag", False)) or quantize(h))
    scoring = start_scoring(load_recipe(plans["online", "fp8"]), 0, 1)
    first, windows, steps = set(scoring.needed(0)), [], 0
    while len(windows) < 3 and steps < scoring.per_epoch:  # the first three windows
        scoring.ensure(steps)
        windows += [] if windows and windows[-1] == scoring.needed(steps) else [scoring.needed(steps)]
        steps += 1
    scoring.features.close()
    table = scoring.features.sequences
    later = {s for window in windows for s in window} - first
    starts = {int(table.row_id[np.flatnonzero(table.shard == table.names.index(s))[0]]) for s in later}
    assert starts and {encoded[r] for r in starts} != {"MainThread"}, "later windows are encoded ahead"
    assert all(encoded[r] != "MainThread" for r in starts), {r: encoded[r] for r in starts}
    assert quantized and all(quantized), "fp8 quantization happens inside score(), batch by batch"


def test_the_cache_keeps_shards_for_later_epochs_and_zero_keeps_only_the_needed(plans):
    online = bound(plans["online", "bf16"])
    names = online.sequences.names
    online.ensure(names[:2])
    online.ensure(names[2:4])
    assert online.scored == 4 and set(online._held) == set(names[2:4]), "cache 0: only what is needed now"
    online.ensure(names[:2])
    assert online.scored == 6, "dropped shards are scored again"
    online.cache_bytes = 1 << 40
    online.ensure(names[2:4])
    online.ensure(names[:2])
    assert online.scored == 8 and set(online._held) == set(names[:4]), "a cache keeps them"
    assert online.pages_needed(2048, 16) >= max(online.sequences.lengths) // 16


def test_online_and_offline_mismatches_and_changed_data_are_one_line_errors(plans, tmp_path):
    online = plans["online", "bf16"]
    with pytest.raises(UserError, match="planned for online training"):
        FeatureReader(load_recipe(online).features_dir)
    assert_one_line_user_error(run_cli("train", online, "precompute.mode=offline"), "planned for online training",
                               "precompute.mode offline")
    assert_one_line_user_error(run_cli("train", plans["offline", "bf16"], "precompute.mode=online"),
                               "stored offline", "precompute.mode online")
    recipe = load_recipe(online)
    changed = write_jsonl(tmp_path / "sgd.jsonl", sgd_rows(81, split="train")[1:])
    moved = recipe.model_copy(update={"data": recipe.data.model_copy(update={"train": [changed]})})
    with pytest.raises(UserError, match="made from other data files than the recipe names now"):
        open_features(moved)


@pytest.mark.slow
def test_online_training_equals_offline_and_resumes_after_sigkill(plans, tmp_path):
    """``mtp-train train`` online: the log's losses and the head's weights equal offline's bit for bit, across a
    SIGKILL after a checkpoint and the rerun that resumes from it."""
    offline, online = plans["offline", "bf16"], plans["online", "bf16"]
    args = ["train.max_steps=12", *elsewhere(offline, tmp_path / "offline")]
    ref = run_train_cli(offline, *args)
    assert ref.returncode == 0, ref.stderr[-2000:]
    run = [*elsewhere(online, tmp_path / "online"), "train.max_steps=12"]
    killed = run_train_cli(online, *run, crash_at="train:4")
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "online" / "checkpoints" / "mtp" / "latest").read_text() == "step-00000004"
    resumed = run_train_cli(online, *run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 4" in resumed.stderr and "0 bytes stored" in resumed.stderr
    assert [r["loss"] for r in log(tmp_path / "online")] == [r["loss"] for r in log(tmp_path / "offline")]
    a = load_file(tmp_path / "online" / "heads" / "mtp" / "model.safetensors")
    b = load_file(tmp_path / "offline" / "heads" / "mtp" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def scored(stderr: str) -> dict[int, int]:
    """Shards each rank says it scored (two ranks' lines may be interleaved on the one stderr pipe)."""
    return {int(r): int(n) for r, n in re.findall(r"rank (\d+)[^:\n]*: online: scored (\d+) shard", stderr)}


@pytest.mark.slow
def test_ddp_and_deepspeed_ranks_score_their_own_shards_and_a_tp_group_scores_together(plans, tmp_path):
    online = plans["online", "bf16"]
    shards = len(json.loads((load_recipe(online).features_dir / "manifest.json").read_text())["shards"])
    one = run_train_cli(online, *elsewhere(online, tmp_path / "one"), "train.epochs=1", "train.grad_accum=2")
    assert one.returncode == 0, one.stderr[-3000:]
    ddp = run_train_cli(online, *elsewhere(online, tmp_path / "ddp"), "train.epochs=1", launcher=2)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    tp = run_train_cli(online, *elsewhere(online, tmp_path / "tp"), "train.epochs=1", "target.tp=2", launcher=2)
    assert tp.returncode == 0, tp.stderr[-3000:]
    zero = run_train_cli(online, *elsewhere(online, tmp_path / "zero"), "train.epochs=1", launcher="deepspeed")
    assert zero.returncode == 0, zero.stderr[-3000:]
    assert all("2 process(es)" in p.stderr for p in (ddp, tp, zero))
    by_rank = scored(ddp.stderr)
    assert set(by_rank) == {0, 1} and sum(by_rank.values()) <= shards and min(by_rank.values()) > 0, by_rank
    assert scored(zero.stderr) == by_rank, "DeepSpeed's ranks score the same slices as DDP's"
    assert scored(one.stderr)[0] <= shards
    group = scored(tp.stderr)
    assert "in a TP group of 2 (ranks [0, 1])" in tp.stderr and group[0] == group[1] == sum(by_rank.values()), group
    for a, b, c in zip(log(tmp_path / "one"), log(tmp_path / "ddp"),
                       log(tmp_path / "tp")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3) and b["loss"] == pytest.approx(c["loss"], rel=1e-3)


@pytest.mark.slow
def test_online_runs_end_to_end_into_a_report_with_no_features_stored(plans, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(plans["online", "fp8"], f"output_dir={out}", "train.max_steps=8", "eval.k=[1, 2]",
                   "eval.temperatures=[0.0]", "eval.prompt_sets=[heldout]", "eval.max_prompts=4",
                   "eval.max_new_tokens=16", "eval.compare=[bigram]", "eval.batch_size=4", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["lossless"] is True and not report["val_mismatch"], report["val_loss"]
    assert [c["name"] for c in report["comparisons"]] == ["bigram"]
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    assert manifest["totals"]["bytes"] == 0 and not list((out / "features").glob("shard-*"))


def test_the_memory_plan_puts_the_target_beside_the_head_online():
    from mtp_train.memory import kv_bytes_per_token, memory_plan
    from mtp_train.models.config import ModelConfig

    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b.yaml")
    config = json.loads((REPO / "recipes" / "configs" / "llama-3.1-8b.json").read_text())
    cfg = ModelConfig.from_hf(config, "llama3.1-8b.json")
    assert recipe.data.regenerate
    online = recipe.model_copy(update={"precompute": recipe.precompute.model_copy(update={"mode": "online"})})
    offline_plans, online_plans = memory_plan(cfg, recipe), memory_plan(cfg, online)
    assert online_plans[0].parts == offline_plans[0].parts and "regenerates answers only" in online_plans[0].note
    planning = online.model_copy(update={"data": online.data.model_copy(update={"regenerate": False})})
    assert memory_plan(cfg, planning)[0].parts == {} and "no target" in memory_plan(cfg, planning)[0].note
    train, base = online_plans[1], offline_plans[1]
    assert train.parts["target"] == offline_plans[0].parts["weights"]
    assert train.parts["scoring"] == offline_plans[0].parts["activations"]
    slots = 2 * recipe.precompute.batch_tokens  # one scoring forward's tokens, with room for its pages
    assert train.parts["KV"] == slots * kv_bytes_per_token(cfg, 1, 2) < offline_plans[0].parts["KV"]
    assert train.parts["buffers"] == offline_plans[0].parts["buffers"]  # the engine's attention workspace
    assert train.total == base.total + sum(train.parts[k] for k in ("target", "scoring", "buffers", "KV"))
    assert "online: the target (TP 1) scores beside the head" in train.line()


def test_slurm_renders_the_online_chain(plans, tmp_path):
    online = plans["online", "bf16"]
    proc = run_cli("slurm", online, "--dry-run", "--nodes", "2", "--gpus-per-node", "8", "target.tp=2")
    assert proc.returncode == 0, proc.stderr
    precompute = proc.stdout.split("precompute.sbatch ----\n", 1)[1].split("# ----", 1)[0]
    assert "#SBATCH --array=0-0" in precompute and "--gres" not in precompute and "\nTP=1\n" in precompute
    train = proc.stdout.split("train.sbatch ----\n", 1)[1].split("# ----", 1)[0]
    assert "#SBATCH --gres=gpu:8" in train and "precompute.mode" not in train
    assert_one_line_user_error(run_cli("slurm", online, "--dry-run", "--procs-per-node", "3", "target.tp=2"),
                               "does not divide the 3 training processes per node")


@pytest.mark.slow
def test_an_online_plan_over_regenerated_rows_encodes_the_targets_answers(tmp_path):
    """With ``data.regenerate``, the plan's rows are the answer files' (precompute wrote them; every training process
    reads them back): their tokens equal offline features made from the same answers."""
    data = write_jsonl(tmp_path / "sgd.jsonl", sgd_rows(6, split="train"))
    regen = {"regenerate": True, "heldout_rows": 1, "sampling": {"max_new_tokens": 12}}
    recipes = {}
    for mode in ("online", "offline"):
        (tmp_path / mode).mkdir()
        recipes[mode] = make_recipe(tmp_path / mode, data, data=regen, precompute={**PRECOMPUTE, "mode": mode})
    proc = run_precompute_cli(recipes["online"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = sorted((tmp_path / "online" / "run" / "features").glob("regenerated.rank-*.jsonl"))
    assert answers, "online precompute regenerates (and keeps) the answers"
    (tmp_path / "offline" / "run" / "features").mkdir(parents=True)
    for f in answers:  # the offline run reuses them instead of generating again
        (tmp_path / "offline" / "run" / "features" / f.name).write_bytes(f.read_bytes())
    proc = run_precompute_cli(recipes["offline"])
    assert proc.returncode == 0 and "already holds" in proc.stderr, proc.stderr[-2000:]
    online = open_features(load_recipe(recipes["online"]))
    offline = open_features(load_recipe(recipes["offline"]))
    for a, b in zip(online.sequences, offline.sequences):
        assert all(torch.equal(online.load(a)[n], offline.load(b)[n]) for n in ("input_ids", "loss_mask"))
    first = json.loads(answers[0].read_text().splitlines()[1])
    assert online.rows.contents([first["row_id"]])[first["row_id"]] == first["messages"]
