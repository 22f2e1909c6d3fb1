"""The trainer's input pipeline: ``load_batch`` is bit for bit the straightforward per-sequence packing."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.train.data import Batch, load_batch, pack_per_sequence, plan_batches
from precompute_helpers import make_recipe, sgd_rows, write_jsonl

FIELDS = ("tokens", "hidden", "loss_mask", "topk_logprobs", "topk_ids", "tail_logprob")


def _precompute(tmp, rows, **precompute):
    from mtp_train.recipe import load_recipe
    from mtp_train.precompute.run import run_precompute

    data = write_jsonl(tmp / "sgd.jsonl", rows)
    recipe = make_recipe(tmp, data, data={"heldout_rows": 2, "max_length": 96},
                         precompute={"shard_tokens": 400, **precompute})
    run_precompute(load_recipe(recipe))
    return tmp / "run" / "features"


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """Two layers and top-8 (so the head's input is a strided slice), in several shards; and K = 0, one layer."""
    rows = sgd_rows(14)
    two_layers = _precompute(tmp_path_factory.mktemp("k8"), rows, layers=[1, -1], topk=8)
    no_topk = _precompute(tmp_path_factory.mktemp("k0"), rows[:6], layers=[-1], topk=0)
    return two_layers, no_topk


def assert_identical(got: Batch, want: Batch) -> None:
    assert got.cu_seqlens == want.cu_seqlens and got.num_tokens == want.num_tokens
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.is_contiguous(), name
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:  # the same bits, NaNs and signed zeros included
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def batches_of(reader, batch_tokens):
    return [[reader.sequences[i] for i in ids] for ids in plan_batches(reader.sequences, batch_tokens, 3, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_tokens", [40, 300])
def test_load_batch_is_bit_identical_to_per_sequence_packing(features, dtype, batch_tokens):
    from mtp_train.features.reader import FeatureReader

    for root in features:
        reader = FeatureReader(root)
        assert len(reader.manifest.shards) > 1
        batches = batches_of(reader, batch_tokens)
        assert batch_tokens < 100 or any(len({r.shard for r in refs}) > 1 for refs in batches)  # batches mix shards
        loaded = [load_batch(reader, refs, batch_tokens, dtype) for refs in batches]
        for refs, got in zip(batches, loaded):  # checked after all were loaded: nothing aliases a reused buffer
            assert_identical(got, pack_per_sequence(reader, refs, batch_tokens, dtype))
        # every sequence at once, some cut to batch_tokens, in shard order and reversed
        for refs in (reader.sequences, reader.sequences[::-1]):
            assert_identical(load_batch(reader, refs, batch_tokens, dtype),
                             pack_per_sequence(reader, refs, batch_tokens, dtype))


def test_every_token_counts_when_asked(features):
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features[0])
    refs = batches_of(reader, 300)[0]
    stored, every = load_batch(reader, refs, 300, torch.float32), load_batch(reader, refs, 300, torch.float32, True)
    assert not stored.loss_mask.all() and every.loss_mask.all()  # prompt tokens too (train.loss_tokens: all)
    assert torch.equal(stored.tokens, every.tokens) and torch.equal(stored.hidden, every.hidden)


def test_cold_page_cache_and_plain_reads_give_the_same_batches(features, monkeypatch):
    """Ranges the page cache misses, wholly or in part, are announced and then read with blocking reads; the batches
    are those of the plain reads. The misses are injected: the non-blocking read returns nothing, or only the
    first half of what it was asked."""
    import mtp_train.features.reader as reader_module

    root = features[0]
    reader = reader_module.FeatureReader(root)
    refs = reader.sequences
    want = pack_per_sequence(reader, refs, 300, torch.float32)
    read_cached, read_into = reader_module._read_cached, reader_module.ShardFile.read_into
    blocking = []
    monkeypatch.setattr(reader_module.ShardFile, "read_into", lambda f, *a: blocking.append(a) or read_into(f, *a))
    misses = {"cold": lambda fd, view, offset: 0,
              "half cached": lambda fd, view, offset: read_cached(fd, view[: len(view) // 2], offset)}
    for name, miss in misses.items():
        blocking.clear()
        monkeypatch.setattr(reader_module, "_read_cached", miss)
        assert_identical(load_batch(reader, refs, 300, torch.float32), want)
        assert blocking, name  # the misses went through the announce-then-read path
    monkeypatch.setattr(reader_module, "_NOWAIT", None)  # platforms without RWF_NOWAIT / posix_fadvise
    monkeypatch.setattr(reader_module, "_WILLNEED", None)
    blocking.clear()
    assert_identical(load_batch(reader_module.FeatureReader(root), refs, 300, torch.float32), want)
    assert blocking


def test_prefetch_thread_and_validation_can_load_at_once(features):
    """The trainer loads the next batch on a thread while validation loads on the main one."""
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features[0])
    batches = batches_of(reader, 60)
    want = [pack_per_sequence(reader, refs, 60, torch.float32) for refs in batches]
    got: dict[tuple[int, int], Batch] = {}

    def work(worker):
        for rep in range(5):
            for i, refs in enumerate(batches):
                got[worker, rep * len(batches) + i] = load_batch(reader, refs, 60, torch.float32)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (_, i), batch in got.items():
        assert_identical(batch, want[i % len(batches)])


def test_a_truncated_shard_is_an_error_naming_it(features, tmp_path):
    from mtp_train.features.reader import FeatureReader

    root = shutil.copytree(features[0], tmp_path / "features")
    reader = FeatureReader(root)
    last = max(reader.sequences, key=lambda r: (r.shard, r.stop))
    with open(root / last.shard, "r+b") as f:
        f.truncate(os.path.getsize(root / last.shard) - 100)
    with pytest.raises(UserError, match=last.shard):
        load_batch(reader, [last], 10_000, torch.float32)


def test_plan_is_a_seeded_shard_windowed_shuffle(features, monkeypatch):
    """Every sequence once per epoch, the same plan for the same seed and epoch, another for the next epoch, and
    each batch within one window of at most SHARD_WINDOW shards; with fewer shards than that, one window."""
    from mtp_train.train import data
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features[0])
    refs = reader.sequences
    shards = {r.shard for r in refs}
    assert len(shards) >= 4
    for window in (2, 3, 100):
        monkeypatch.setattr(data, "SHARD_WINDOW", window)
        plans = {}
        for seed, epoch in ((3, 0), (3, 1), (4, 0)):
            plan = plan_batches(refs, 300, seed, epoch)
            assert plan == plan_batches(refs, 300, seed, epoch)
            assert sorted(i for ids in plan for i in ids) == list(range(len(refs)))
            windows = data.plan_windows(refs, seed, epoch)
            assert sorted(s for w in windows for s in w) == sorted(shards)
            assert all(len(w) <= window for w in windows)
            # batches follow the windows in order, none spans two
            at = [next(k for k, w in enumerate(windows) if refs[ids[0]].shard in w) for ids in plan]
            assert at == sorted(at)
            for ids, k in zip(plan, at):
                assert {refs[i].shard for i in ids} <= set(windows[k])
                assert sum(min(refs[i].stop - refs[i].start, 300) for i in ids) <= 300 or len(ids) == 1
            plans[seed, epoch] = plan
        assert plans[3, 0] != plans[3, 1] and plans[3, 0] != plans[4, 0]
        if window >= len(shards):  # one window: a global shuffle, each batch may mix every shard
            assert len(data.plan_windows(refs, 3, 0)) == 1


def test_load_batch_reads_the_window_and_the_next_one_ahead(features, monkeypatch):
    """A planned batch asks the reader for its window's and the next window's shard files (once per window); a
    batch that is not in the plan (validation) asks for nothing; the batches are the same either way."""
    from mtp_train.train import data
    from mtp_train.features.reader import FeatureReader

    monkeypatch.setattr(data, "SHARD_WINDOW", 2)
    reader = FeatureReader(features[0])
    refs = reader.sequences
    asked = []
    monkeypatch.setattr("mtp_train.features.reader._read_whole", lambda f: asked.append(os.path.basename(f.path)))
    plan = plan_batches(refs, 300, 3, 0)
    windows = data.plan_windows(refs, 3, 0) + data.plan_windows(refs, 3, 1)[:1]
    got = [load_batch(reader, [refs[i] for i in ids], 300, torch.float32) for ids in plan]
    reader.reset_read_ahead()
    want, before = [], set()  # each window asks for itself and the next, less what the previous one asked for
    for w, after in zip(windows, windows[1:]):
        named = list(dict.fromkeys(w + after))
        want += [s for s in named if s not in before]
        before = set(named)
    assert len(windows) >= 3 and asked == want
    plain = FeatureReader(features[0])
    for ids, batch in zip(plan, got):
        assert_identical(batch, pack_per_sequence(plain, [refs[i] for i in ids], 300, torch.float32))
    before = len(asked)
    load_batch(reader, refs[1:3], 300, torch.float32)
    assert len(asked) == before


def test_the_draft_vocabulary_counts_over_the_vocabulary_once_per_chunk_not_per_sequence(features, monkeypatch):
    """The same ids as one count per sequence, with one ``bincount`` per ``COUNT_TOKENS`` assistant tokens."""
    import mtp_train.train.vocab as vocab
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features[0])
    counts = torch.zeros(4096, dtype=torch.int64)
    for ref in reader.train:
        rows = reader.load(ref)
        counts += torch.bincount(rows["input_ids"].long()[rows["loss_mask"].bool()], minlength=4096)
    want = torch.argsort(counts, descending=True, stable=True)[:100].sort().values
    calls = []
    bincount = torch.bincount
    monkeypatch.setattr(vocab.torch, "bincount", lambda *a, **k: calls.append(1) or bincount(*a, **k))
    assert torch.equal(vocab.frequent_tokens(reader, 100, 4096), want)
    assert len(calls) == 1 < len(reader.train)
    monkeypatch.setattr(vocab, "COUNT_TOKENS", int(counts.sum()) // 3)
    calls.clear()
    assert torch.equal(vocab.frequent_tokens(reader, 100, 4096), want)
    assert 3 <= len(calls) <= 4


def test_ranks_count_the_draft_vocabulary_over_their_own_shards_and_agree(features, monkeypatch):
    """Over 3 ranks each reads the sequences of its share of the shards only (an online plan encodes a shard to read
    it), and the summed counts give every rank the ids one rank counting alone picks."""
    import mtp_train.train.vocab as vocab
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features[0])
    shards = list(dict.fromkeys(ref.shard for ref in reader.train))
    assert len(shards) >= 3, "the fixture's features span several shards"
    alone = vocab.frequent_tokens(reader, 100, 4096)
    parts, read = [], {}
    load = reader.load
    for rank in range(3):
        seen = read.setdefault(rank, set())
        monkeypatch.setattr(reader, "load", lambda ref, seen=seen: seen.add(ref.shard) or load(ref))
        vocab.frequent_tokens(reader, 100, 4096, rank, 3, lambda c: parts.append(c) or c)
    assert all(not (read[a] & read[b]) for a in read for b in read if a < b), read
    assert set().union(*read.values()) == set(shards)
    summed = sum(parts)
    assert torch.equal(vocab.frequent_tokens(reader, 100, 4096, 0, 3, lambda c: summed), alone)
