"""Precompute: formats and masks, round trip through score(), resume after SIGKILL, two ranks, corruption."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_TARGET, pause_env, paused_processes, resume, run_cli
from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe
from mtp_train.data.dataset import encode, load_rows
from precompute_helpers import make_recipe, other_target, run_precompute_cli, sgd_rows, shard_contents, write_jsonl


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_TARGET)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted in-process run over 40 SGD dev dialogues."""
    from mtp_train.precompute.run import run_precompute

    tmp = tmp_path_factory.mktemp("reference")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(40))
    recipe_path = make_recipe(tmp, data)
    manifest = run_precompute(load_recipe(recipe_path))
    return tmp, recipe_path, data, manifest


def test_three_formats_give_identical_tokens_and_assistant_masks(tmp_path, tokenizer):
    row = sgd_rows(1)[0]
    convo = row["conversations"][:2]  # one user turn, one assistant turn
    roles = {"human": "user", "gpt": "assistant"}
    files = {
        "sharegpt": write_jsonl(tmp_path / "a.jsonl", [{"conversations": convo}]),
        "openai": write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": roles[t["from"]], "content": t["value"]}
                                                                   for t in convo]}]),
        "prompt_completion": write_jsonl(tmp_path / "c.jsonl", [{"prompt": convo[0]["value"],
                                                                 "completion": convo[1]["value"]}]),
    }
    encoded = {}
    for fmt, path in files.items():
        data = load_rows([path], "auto", False, None)
        assert data.formats[str(path)] == fmt
        encoded[fmt] = encode(tokenizer, data.rows[0].content, 512)
    assert encoded["sharegpt"] == encoded["openai"] == encoded["prompt_completion"]
    ids, mask, truncated = encoded["openai"]
    assert not truncated
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == convo[1]["value"] + "<|eot|>"


def test_multi_turn_mask_is_exactly_the_assistant_spans(tokenizer):
    row = sgd_rows(2)[1]
    data_rows = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
                 for t in row["conversations"]]
    ids, mask, _ = encode(tokenizer, data_rows, 4096)
    expected = "".join(m["content"] + "<|eot|>" for m in data_rows if m["role"] == "assistant")
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == expected


def test_round_trip_every_row_equals_a_fresh_score(reference):
    from mtp_train.runtime.engine import Engine

    tmp, _, _, manifest = reference
    assert manifest.complete and len(manifest.shards) >= 3, "small shards so that resume has boundaries to test"
    engine = Engine.from_pretrained(TINY_TARGET)
    stored = shard_contents(tmp / "run" / "features")
    assert sorted(stored) == list(range(40))
    for row_id, t in stored.items():
        fresh = engine.score([t["input_ids"].tolist()], layers=[1, -1], topk=8)
        assert torch.allclose(t["hidden"].float(), fresh.hidden.to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2)
        assert torch.equal(t["topk_ids"].long(), fresh.topk_ids)
        assert torch.allclose(t["topk_logprobs"].float(), fresh.topk_logprobs, atol=2e-2, rtol=1e-2)
        assert torch.allclose(t["logsumexp"], fresh.logsumexp, atol=1e-4)


def test_manifest_records_the_contract(reference):
    tmp, _, _, manifest = reference
    data = json.loads((tmp / "run/features/manifest.json").read_text())
    assert data["format_version"] == 3 and data["last_layer_pre_norm"] is True
    assert data["layers"] == [1, 3] and data["topk"] == 8 and data["hidden_size"] == 128
    assert set(data["fingerprint"]) == {"target", "tokenizer", "chat_template", "data", "settings"}
    assert data["totals"]["tokens"] == sum(s["num_tokens"] for s in data["shards"])
    assert data["totals"]["bytes_per_token"] > 0
    assert len(data["heldout_row_ids"]) == 4
    for shard in data["shards"]:
        assert len(shard["sha256"]) == 64 and shard["num_seqs"] and "row_ids" not in shard


def test_verify_passes_and_rerun_skips(reference):
    tmp, recipe, _, _ = reference
    proc = run_cli("verify", tmp / "run/features")
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout
    again = run_precompute_cli(recipe)
    assert again.returncode == 0 and "skipped" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["forward:1", "write:2", "manifest:1"])
def test_sigkill_then_resume_equals_an_uninterrupted_run(reference, tmp_path, crash_at):
    ref_tmp, _, data, _ = reference
    recipe = make_recipe(tmp_path, data)
    killed = run_precompute_cli(recipe, crash_at=crash_at)
    assert killed.returncode == -signal.SIGKILL
    features = tmp_path / "run" / "features"
    point, index = crash_at.split(":")
    index = int(index)
    if point == "write":
        assert list(features.glob(".shard-*.tmp")), "a half-written temp file is left behind"
    if point == "manifest":
        assert (features / f"shard-00000-{index:05d}.safetensors").is_file(), "a shard the manifest never recorded"
    resumed = run_precompute_cli(recipe)
    assert resumed.returncode == 0, resumed.stderr
    done = int(resumed.stderr.split(" already done")[0].rsplit(" ", 1)[1])
    # The writer works behind the forward, so a crash mid-forward may also lose the shard in flight.
    assert done == index if point != "forward" else done <= index
    assert not list(features.glob(".*.tmp"))
    assert run_cli("verify", features).returncode == 0
    ours, ref = shard_contents(features), shard_contents(ref_tmp / "run" / "features")
    assert sorted(ours) == sorted(ref)
    for row_id in ref:
        for name in ref[row_id]:
            assert torch.equal(ours[row_id][name], ref[row_id][name]), (row_id, name)


@pytest.mark.slow
def test_two_ranks_cover_the_same_rows_as_one(reference, tmp_path):
    ref_tmp, _, data, ref_manifest = reference
    recipe = make_recipe(tmp_path, data)
    procs = [
        subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "precompute", str(recipe), "--rank", str(r),
                          "--world-size", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    features = tmp_path / "run" / "features"
    merged = json.loads((features / "manifest.json").read_text())
    assert sorted(merged["ranks"]) == [0, 1]
    assert {s["file"][:12] for s in merged["shards"]} == {"shard-00000-", "shard-00001-"}
    assert run_cli("verify", features).returncode == 0
    ours, ref = shard_contents(features), shard_contents(ref_tmp / "run" / "features")
    assert sorted(ours) == sorted(ref)
    for row_id in ref:
        assert torch.equal(ours[row_id]["input_ids"], ref[row_id]["input_ids"])
        assert torch.equal(ours[row_id]["loss_mask"], ref[row_id]["loss_mask"])
        assert torch.allclose(ours[row_id]["hidden"].float(), ref[row_id]["hidden"].float(), atol=2e-2, rtol=1e-2)


@pytest.fixture
def copy_of_reference(reference, tmp_path):
    src = reference[0] / "run" / "features"
    dst = tmp_path / "features"
    shutil.copytree(src, dst)
    return dst


def assert_verify_fails(features, *needles):
    proc = run_cli("verify", features)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[0]
    for needle in needles:
        assert needle in line, line


def test_truncated_shard_is_detected(copy_of_reference):
    shard = sorted(copy_of_reference.glob("shard-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_verify_fails(copy_of_reference, shard.name, "truncated")


def test_flipped_byte_is_detected(copy_of_reference):
    shard = sorted(copy_of_reference.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert_verify_fails(copy_of_reference, shard.name, "sha256 mismatch")


def test_missing_shard_is_detected(copy_of_reference):
    shard = sorted(copy_of_reference.glob("shard-*.safetensors"))[2]
    shard.unlink()
    assert_verify_fails(copy_of_reference, shard.name, "missing")


def test_features_from_another_target_are_refused(copy_of_reference, tmp_path):
    from mtp_train.features.reader import FeatureReader

    other = other_target(tmp_path)
    assert len(FeatureReader(copy_of_reference, target=TINY_TARGET).train) == 36
    with pytest.raises(UserError, match="different target"):
        FeatureReader(copy_of_reference, target=other)


def test_rerun_with_a_changed_recipe_names_the_field_and_overwrite_replaces(reference, tmp_path):
    _, _, data, _ = reference
    recipe = make_recipe(tmp_path, data, data={"max_rows": 6})
    assert run_precompute_cli(recipe).returncode == 0
    changed = make_recipe(tmp_path, data, data={"max_rows": 6}, precompute={"topk": 4})
    proc = run_precompute_cli(changed)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "topk" in proc.stderr and "--overwrite" in proc.stderr
    assert run_precompute_cli(changed, "--overwrite").returncode == 0
    assert json.loads((tmp_path / "run/features/manifest.json").read_text())["topk"] == 4


def test_template_without_markers_given_as_data_chat_template_masks_the_same_tokens(tmp_path):
    template = (TINY_TARGET / "chat_template.jinja").read_text()
    plain = tmp_path / "plain.jinja"
    plain.write_text(template.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    data = write_jsonl(tmp_path / "d.jsonl", sgd_rows(6))
    marked_dir, plain_dir = tmp_path / "marked", tmp_path / "plain"
    marked_dir.mkdir(), plain_dir.mkdir()
    for where, extra in ((marked_dir, {}), (plain_dir, {"chat_template": str(plain)})):
        proc = run_precompute_cli(make_recipe(where, data, data=extra))
        assert proc.returncode == 0, proc.stderr
        assert f"{data}: " in proc.stderr and "of its tokens masked in" in proc.stderr
    marked, unmarked = shard_contents(marked_dir / "run/features"), shard_contents(plain_dir / "run/features")
    assert marked.keys() == unmarked.keys()
    for row in marked:
        assert torch.equal(marked[row]["input_ids"], unmarked[row]["input_ids"])
        assert torch.equal(marked[row]["loss_mask"], unmarked[row]["loss_mask"])
    fingerprints = [json.loads((d / "run/features/manifest.json").read_text())["fingerprint"]["chat_template"]
                    for d in (marked_dir, plain_dir)]
    assert fingerprints[0] != fingerprints[1], "the manifest fingerprints the template actually used"


def test_file_whose_mask_is_empty_everywhere_is_refused(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    template = (target / "chat_template.jinja").read_text()
    empty = template.replace("{% endgeneration %}", "").replace("{% generation %}", "{% generation %}{% endgeneration %}")
    (target / "chat_template.jinja").write_text(empty)
    data = write_jsonl(tmp_path / "d.jsonl", sgd_rows(3))
    recipe = make_recipe(tmp_path, data, target={"path": str(target)})
    proc = run_precompute_cli(recipe)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{data}: " in proc.stderr and "empty loss mask" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list((tmp_path / "run").rglob("*.safetensors"))


def test_missing_chat_template_file_is_one_line(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sgd_rows(2))
    proc = run_precompute_cli(make_recipe(tmp_path, data, data={"chat_template": str(tmp_path / "nope.jinja")}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.chat_template" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_row_names_row_and_file_unless_skipping_is_allowed(tmp_path):
    rows = sgd_rows(3)
    rows[1] = {"conversations": [{"from": "robot", "value": "beep"}]}
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    proc = run_precompute_cli(make_recipe(tmp_path, data))
    assert proc.returncode == 2 and "bad.jsonl: row 1" in proc.stderr
    ok = run_precompute_cli(make_recipe(tmp_path, data, data={"skip_bad_rows": True, "heldout_rows": 0}))
    assert ok.returncode == 0, ok.stderr
    manifest = json.loads((tmp_path / "run/features/manifest.json").read_text())
    assert [s["index"] for s in manifest["skipped_rows"]] == [1]
    assert sorted(shard_contents(tmp_path / "run/features")) == [0, 2]


def test_truncation_is_counted(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sgd_rows(5))
    proc = run_precompute_cli(make_recipe(tmp_path, data, data={"max_length": 64, "heldout_rows": 0}))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "run/features/manifest.json").read_text())
    assert manifest["truncated_rows"] == 5
    assert all(s["num_tokens"] == 64 * s["num_seqs"] for s in manifest["shards"])


def test_regeneration_replaces_answers_with_the_targets_own(tmp_path, tokenizer):
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    rows = [{"conversations": r["conversations"][:2]} for r in sgd_rows(3)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    recipe = make_recipe(tmp_path, data, data={"regenerate": True, "heldout_rows": 0,
                                               "sampling": {"temperature": 0.0, "max_new_tokens": 24}})
    # Killed right after the answers were saved: the rerun reuses them and generates nothing.
    killed = run_precompute_cli(recipe, crash_at="regenerate:0")
    assert killed.returncode == -9, killed.stderr
    assert len((tmp_path / "run/features/regenerated.rank-00000.jsonl").read_text().splitlines()) == 1 + 3
    proc = run_precompute_cli(recipe)
    assert proc.returncode == 0, proc.stderr
    assert "already holds 3 of 3 rows" in proc.stderr and "regenerate: 3/3 rows" not in proc.stderr, "nothing generated"
    manifest = json.loads((tmp_path / "run/features/manifest.json").read_text())
    assert manifest["regenerated"] is True and manifest["sampling"]["max_new_tokens"] == 24
    stored = shard_contents(tmp_path / "run" / "features")
    engine = Engine.from_pretrained(TINY_TARGET)
    for row_id, row in enumerate(rows):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["conversations"][0]["value"]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        answer = engine.generate([prompt], SamplingParams(max_new_tokens=24))[0].tokens
        text = tokenizer.decode([t for t in answer if t not in engine.stop_ids], skip_special_tokens=True)
        ids, mask = stored[row_id]["input_ids"].tolist(), stored[row_id]["loss_mask"].tolist()
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == text + "<|eot|>"


@pytest.mark.slow
def test_tensor_parallel_worker_writes_the_same_features(reference, tmp_path):
    ref_tmp, _, data, _ = reference
    recipe = make_recipe(tmp_path, data, target={"tp": 2})
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "mtp_train.cli", "precompute", str(recipe)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    features = tmp_path / "run" / "features"
    assert run_cli("verify", features).returncode == 0
    ours, ref = shard_contents(features), shard_contents(ref_tmp / "run" / "features")
    assert sorted(ours) == sorted(ref)
    for row_id in ref:
        assert torch.equal(ours[row_id]["input_ids"], ref[row_id]["input_ids"])
        assert torch.allclose(ours[row_id]["hidden"].float(), ref[row_id]["hidden"].float(), atol=2e-2, rtol=1e-2)


def test_each_shard_is_read_back_while_later_shards_are_scored(tmp_path, monkeypatch):
    """A worker reads each shard back from disk as it lands, beside the forwards of the next ones, not all of them
    after its last forward: shard s - 2 has been hashed from disk by the time shard s is scored."""
    import threading

    from mtp_train.features import verify
    from mtp_train.precompute.run import run_precompute
    from mtp_train.runtime.engine import Engine

    recipe = load_recipe(make_recipe(tmp_path, write_jsonl(tmp_path / "d.jsonl", sgd_rows(16)),
                                     precompute={"shard_tokens": 400}))
    hashed: list[str] = []
    landed = threading.Condition()
    sha256 = verify._sha256

    def hash_file(path):
        digest = sha256(path)
        with landed:
            hashed.append(path.name)
            landed.notify_all()
        return digest

    score, calls = Engine.score, []

    def score_after_read_back(engine, sequences, *args, **kwargs):
        s = len(calls)
        calls.append(s)
        if s >= 2:
            want = f"shard-00000-{s - 2:05d}.safetensors"
            with landed:
                assert landed.wait_for(lambda: want in hashed, timeout=20), f"{want} not read back before shard {s}"
        return score(engine, sequences, *args, **kwargs)

    monkeypatch.setattr(verify, "_sha256", hash_file)
    monkeypatch.setattr(Engine, "score", score_after_read_back)
    manifest = run_precompute(recipe)
    assert len(manifest.shards) >= 4 and len(calls) == len(manifest.shards)
    assert sorted(hashed) == sorted(s.file for s in manifest.shards), "each shard is read back once"


def test_a_worker_reads_back_its_shards_before_it_is_complete(tmp_path):
    """A shard damaged on disk after it was written (while the run is paused before reading it back, the pause
    hook) is found by the worker that wrote it: one line, exit 2, and its manifest is not marked complete."""
    recipe = make_recipe(tmp_path, write_jsonl(tmp_path / "d.jsonl", sgd_rows(12)))
    env = pause_env("readback", 0, tmp_path / "paused")
    proc = subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "precompute", str(recipe)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    paused = paused_processes(tmp_path / "paused", 1, proc)
    features = tmp_path / "run" / "features"
    shard = features / "shard-00000-00000.safetensors"  # the pause is before shard 0 is read back
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern flipped in the last tensor's data: same size, a valid header
    shard.write_bytes(bytes(data))
    resume(paused)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "rank 0's shards do not read back as written (1 of " in last and f"{shard}: sha256 mismatch" in last, last
    assert not json.loads((features / "manifest.rank-00000.json").read_text())["complete"]
    assert not (features / "manifest.json").exists()


def test_a_setting_the_new_recipe_no_longer_has_is_named_too():
    """Features an eagle3 recipe made (its aux layers among the settings) met by an mtp recipe: the refusal names the
    setting only the old features have, not an empty list."""
    from types import SimpleNamespace
    from precompute.directory import _mismatch
    old = SimpleNamespace(fingerprint={"settings": "a"}, settings={"topk": 32, "eagle3_layers": [1, 8, 14]})
    assert _mismatch(old, {"settings": "b"}, {"topk": 32}) == "recipe field(s) eagle3_layers"
