"""What keeps host memory and I/O flat at scale: each worker converts only its own rows, the manifest is a summary
with the per-sequence index beside it, a reader opens each shard once at start-up, and each training rank reads only
the shard windows assigned to it. (``bench/scale_sim.py`` measures the same at 10M conversations.)"""

from __future__ import annotations

import builtins
import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conftest import run_cli
from mtp_train.errors import UserError
from precompute_helpers import make_recipe, sgd_rows, write_jsonl


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """Two precompute ranks over 24 rows, cut into small shards (several per rank)."""
    from mtp_train.precompute.run import run_precompute
    from mtp_train.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("scale")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(24))
    recipe = load_recipe(make_recipe(tmp, data, data={"heldout_rows": 2, "max_length": 96},
                                     precompute={"shard_tokens": 300, "layers": [-1], "topk": 4}))
    for rank in (0, 1):
        run_precompute(recipe, rank=rank, world=2)
    return tmp / "run" / "features"


def test_a_worker_converts_only_the_rows_of_its_block(tmp_path, monkeypatch):
    """Rank 1 of 4 over 40 rows converts rows 10..19 and no other (every row was converted before slicing)."""
    from mtp_train.data import dataset

    data = write_jsonl(tmp_path / "d.jsonl", sgd_rows(40))
    converted = []
    convert = dataset.to_messages
    monkeypatch.setattr(dataset, "to_messages", lambda raw, fmt: converted.append(raw) or convert(raw, fmt))
    loaded = dataset.load_rows([data], "auto", False, None, (1, 4))
    assert [r.row_id for r in loaded.rows] == list(range(10, 20)) and loaded.num_rows == 40
    assert len(converted) == 10
    converted.clear()
    assert [r.row_id for r in dataset.load_rows([data], "auto", False, 30, (2, 3)).rows] == list(range(20, 30))
    assert len(converted) == 10


def test_the_manifest_is_a_summary_and_the_index_holds_each_shards_sequences(features):
    """No row id or sequence length in ``manifest.json``; each rank's index holds, once per shard, its sequences'
    row ids and tokens, which are the shards' own header row ids and ``cu_seqlens``."""
    from mtp_train.features.index import index_name
    from mtp_train.features.reader import FeatureReader

    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and "row_ids" not in manifest
    assert all(set(s) == {"file", "rank", "num_seqs", "num_tokens", "sha256", "bytes"} for s in manifest["shards"])
    assert manifest["num_rows"] == 24 and len(manifest["heldout_row_ids"]) == 2
    covered = []
    for rank in (0, 1):
        index = load_file(str(features / index_name(rank)))
        shards = [s for s in manifest["shards"] if s["rank"] == rank]
        assert len(shards) >= 2 and index["shard_seqs"].tolist() == [s["num_seqs"] for s in shards]
        at = 0
        for entry, n in zip(shards, index["shard_seqs"]):
            tokens = index["seq_tokens"][at : at + n]
            rows = index["row_ids"][at : at + n].tolist()
            with open(features / entry["file"], "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            assert json.loads(header["__metadata__"]["row_ids"]) == rows
            assert int(tokens.sum()) == entry["num_tokens"]
            from safetensors import safe_open
            with safe_open(features / entry["file"], framework="np") as f:
                assert np.array_equal(np.diff(f.get_tensor("cu_seqlens")), tokens)
            covered += rows
            at += n
    assert sorted(covered) == list(range(24))
    reader = FeatureReader(features)
    assert sorted(reader.sequences.row_id.tolist()) == list(range(24))
    assert len(reader.train) == 22 and sorted(reader.heldout.row_id.tolist()) == manifest["heldout_row_ids"]


def test_a_reader_opens_each_shard_once_at_start_up(features, monkeypatch):
    """Start-up reads the manifest and the indexes, and opens each shard once (for its header): not a second time
    for its ``cu_seqlens``."""
    from mtp_train.features import reader as reader_module

    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def count(path, *a, **k):
        opened.append(os.path.basename(str(path)))
        return real_open(path, *a, **k)

    def count_os(path, *a, **k):
        opened.append(os.path.basename(str(path)))
        return real_os_open(path, *a, **k)

    def count_safe_open(path, *a, **k):
        opened.append(os.path.basename(str(path)))
        from safetensors import safe_open
        return safe_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", count)
    monkeypatch.setattr(os, "open", count_os)
    monkeypatch.setattr(reader_module, "safe_open", count_safe_open, raising=False)
    reader = reader_module.FeatureReader(features)
    shards = sorted(p.name for p in features.glob("shard-*.safetensors"))
    assert sorted(n for n in opened if n.startswith("shard-")) == shards
    assert len(reader.sequences) == 24


def test_features_of_the_previous_format_are_refused_in_one_line(features, tmp_path):
    import shutil

    old = tmp_path / "features"
    shutil.copytree(features, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 2
    (old / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("verify", old)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert f"{old / 'manifest.json'}: features format 2 is not this toolkit's format 3" in line
    assert "rerun precompute" in line


def test_each_training_rank_reads_only_the_shard_windows_assigned_to_it(features, monkeypatch):
    """Two ranks: each one's batches draw on its own windows only, and it asks the reader for those files and the
    first window it visits next epoch, never for the other rank's; together they are the one-rank plan."""
    from mtp_train.train import data
    from mtp_train.features.reader import FeatureReader

    monkeypatch.setattr(data, "SHARD_WINDOW", 1)
    reader = FeatureReader(features)
    refs = reader.train
    windows, following = data.plan_windows(refs, 3, 0), data.plan_windows(refs, 3, 1)
    assert len(windows) >= 4
    whole = data.plan_batches(refs, 300, 3, 0)
    seen, read = [], {}
    for rank in (0, 1):
        asked: list[str] = []
        monkeypatch.setattr("mtp_train.features.reader._read_whole", lambda f: asked.append(os.path.basename(f.path)))
        plan = data.plan_batches(refs, 300, 3, 0, lane=rank, lanes=2)
        mine = {s for w in windows[rank::2] for s in w}
        r = FeatureReader(features)
        for ids in plan:
            assert {refs[i].shard for i in ids} <= mine
            data.load_batch(r, [refs[i] for i in ids], 300, torch.float32)
        r.reset_read_ahead()
        assert set(asked) == mine | set(following[rank]) and len(asked) <= len(mine) + len(following[rank])
        read[rank] = set(asked) - set(following[rank])
        seen += list(plan)
    assert not read[0] & read[1]
    assert sorted(map(tuple, seen)) == sorted(map(tuple, whole))


def test_an_index_that_does_not_match_its_manifest_is_one_line(features, tmp_path):
    import shutil

    from mtp_train.features.index import index_name
    from mtp_train.features.reader import FeatureReader

    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    (copy / index_name(1)).unlink()
    with pytest.raises(UserError, match=f"{copy / index_name(1)}: missing .*rerun precompute"):
        FeatureReader(copy)


def test_a_step_trains_on_the_same_lanes_whatever_the_split_into_ranks_and_micro_batches(features, monkeypatch):
    """One process with 2 micro-batches per step plans exactly the lanes of two processes with one each; the
    micro-batches of one step read ahead the same files."""
    from mtp_train.train import data
    from mtp_train.features.reader import FeatureReader

    monkeypatch.setattr(data, "SHARD_WINDOW", 1)
    refs = FeatureReader(features).train
    two = [data.plan_rank(refs, 300, 3, 0, rank, 2, 1)[0] for rank in (0, 1)]
    one = data.plan_rank(refs, 300, 3, 0, 0, 1, 2)
    assert one == two
    for step in range(min(map(len, one))):
        named = {data._readahead[p.keys[step]] for p in one}
        assert len(named) == 1 and {s for p in one for s in p.ahead[step]} == set(next(iter(named)))
