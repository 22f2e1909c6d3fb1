"""Building blocks of the runtime, each alone: pages, batch metadata, sampling, acceptance, scheduling."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET
from mtp_train.models.config import ModelConfig
from mtp_train.runtime.acceptance import accept_draft
from mtp_train.runtime.batch import build_batch
from mtp_train.runtime.device import resolve_dtype
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.kv_cache import KVPool, OutOfPages, PageAllocator, PageTable, SplitAllocator
from mtp_train.runtime.sampling import SamplingParams, target_distribution

CFG = ModelConfig("llama", 32, 16, 32, 2, 2, 1, 8, 1e-6, 128)


def test_one_allocation_serves_target_and_draft_pools():
    alloc = PageAllocator(num_pages=6, page_size=4)
    target, draft = KVPool(CFG, alloc, torch.float32, torch.device("cpu")), KVPool(
        ModelConfig("llama", 32, 8, 16, 1, 1, 1, 8, 1e-6, 128), alloc, torch.float32, torch.device("cpu")
    )
    table = PageTable()
    alloc.reserve(table, 9)
    assert len(table.pages) == 3 and alloc.num_free == 3
    for pool in (target, draft):
        assert all(p < pool.k.shape[1] for p in table.pages)


def test_reserve_is_all_or_nothing_and_truncate_frees_rejected_tokens():
    alloc = PageAllocator(num_pages=3, page_size=4)
    a, b = PageTable(), PageTable()
    alloc.reserve(a, 6)
    with pytest.raises(OutOfPages):
        alloc.reserve(b, 9)
    assert b.pages == [] and b.num_tokens == 0 and alloc.num_free == 1
    alloc.reserve(a, 5)  # speculative: 6 accepted + 5 draft tokens = 11 -> 3 pages
    assert len(a.pages) == 3 and alloc.num_free == 0
    alloc.truncate(a, 7)  # 1 of the 5 accepted
    assert a.num_tokens == 7 and len(a.pages) == 2 and alloc.num_free == 1
    alloc.free(a)
    assert alloc.num_free == 3


def test_a_split_allocator_keeps_the_windowed_pages_of_the_window_alone():
    """Window 6, pages of 4: a 20-token prefill takes 5 pages in each pool; at the next reservation (its positions
    from 20 on see keys above 14), the windowed pages wholly below 15 go back (0-3, 4-7, 8-11), the global ones stay;
    truncating and freeing return every page; a reservation that the windowed pool alone cannot take touches neither."""
    alloc = SplitAllocator(num_pages=12, page_size=4, window_pages=6, window=6)
    table = PageTable()
    alloc.reserve(table, 20)
    assert (alloc.num_free, alloc.windowed.num_free) == (7, 1)
    alloc.reserve(table, 4)
    assert len(table.pages) == len(table.window.pages) == 6 and table.window.num_tokens == 24
    stand_in = alloc.windowed.stand_in
    assert table.window.pages[:3] == [stand_in] * 3 and stand_in not in table.window.pages[3:]
    assert (alloc.num_free, alloc.windowed.num_free) == (6, 3)
    other = PageTable()
    assert not alloc.can_reserve([(other, 16)]) and alloc.can_reserve([(other, 12)])
    with pytest.raises(OutOfPages, match="windowed"):
        alloc.reserve(other, 16)  # 4 global pages of 6 free, but 4 windowed of 3
    assert other.pages == [] and other.num_tokens == 0 and (alloc.num_free, alloc.windowed.num_free) == (6, 3)
    alloc.truncate(table, 17)  # (rejected drafts): the last page of each pool goes back
    assert len(table.window.pages) == 5 and (alloc.num_free, alloc.windowed.num_free) == (7, 4)
    alloc.free(table)
    assert (alloc.num_free, alloc.windowed.num_free) == (12, 6) and alloc.holds(24) and not alloc.holds(25)


def test_batch_metadata_is_flat_and_indptr_style():
    meta = build_batch([[5, 6, 7], [8]], cached_lens=[0, 5], page_tables=[[2], [0, 3]], page_size=4,
                       device=torch.device("cpu"))
    assert meta.qo_indptr.tolist() == [0, 3, 4] and meta.qo_indptr.dtype == torch.int32
    assert meta.kv_lens.tolist() == [3, 6]
    assert meta.positions.tolist() == [0, 1, 2, 5]
    assert meta.page_indptr.tolist() == [0, 1, 3] and meta.page_indices.tolist() == [2, 0, 3]
    assert meta.last_page_len.tolist() == [3, 2]
    assert meta.slot_mapping.tolist() == [8, 9, 10, 13]
    assert meta.last_token_index.tolist() == [2, 3]
    # The host's copies, which the planners read instead of the device's
    assert meta.host_qo_indptr.tolist() == [0, 3, 4] and meta.host_kv_lens.tolist() == [3, 6]
    assert meta.host_page_indptr.tolist() == [0, 1, 3] and meta.host_last_page_len.tolist() == [3, 2]
    assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (meta.host_qo_indptr, meta.host_kv_lens))


def test_batch_metadata_takes_tokens_already_on_the_device(monkeypatch):
    """A draft chain's samples stay where they are; the rest of the metadata arrives in one pinned copy."""
    from fake_cuda import fake_cuda

    with fake_cuda(monkeypatch) as mode:
        tokens = [torch.tensor([7], device="cuda"), torch.tensor([9], device="cuda")]
        start = len(mode.syncs)
        meta = build_batch(tokens, cached_lens=[3, 5], page_tables=[[2], [0, 3]], page_size=4, device=torch.device("cuda"))
        assert mode.syncs[start:] == []
        assert meta.tokens.device.type == "cuda" and meta.tokens.cpu().tolist() == [7, 9]
        assert meta.slot_mapping.device.type == "cuda" and meta.slot_mapping.cpu().tolist() == [11, 13]
        assert meta.host_qo_indptr.device.type == "cpu" and meta.host_qo_indptr.is_pinned()


def test_top_k_and_top_p_shape_the_distribution():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    greedy = target_distribution(logits, SamplingParams())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    topk = target_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (topk[0, 2:] == 0).all() and topk[0, :2].sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    p = float(full[0] + full[1]) - 1e-3  # just below the first two tokens' mass
    topp = target_distribution(logits, SamplingParams(temperature=1.0, top_p=p))
    assert (topp[0, :2] > 0).all() and (topp[0, 2:] == 0).all()
    hot = target_distribution(logits, SamplingParams(temperature=0.5))
    assert hot[0, 0] > full[0]


def test_greedy_acceptance_counts_a_hand_computed_example():
    vocab = 6
    target_argmax = [2, 4, 1, 5]  # target's choice at draft positions 1..3 and after them
    target = torch.nn.functional.one_hot(torch.tensor(target_argmax), vocab).float()
    draft_tokens = torch.tensor([2, 4, 3])  # third disagrees
    draft = torch.nn.functional.one_hot(draft_tokens, vocab).float()
    assert accept_draft(draft_tokens, draft, target) == (2, 1)  # keep 2, then the target's token 1
    all_good = torch.tensor([2, 4, 1])
    assert accept_draft(all_good, torch.nn.functional.one_hot(all_good, vocab).float(), target) == (3, 5)
    assert accept_draft(torch.tensor([0, 4, 1]), draft, target)[0] == 0


@pytest.mark.parametrize("quality", ["bad", "good"])
def test_speculative_sampling_reproduces_the_target_distribution(quality):
    """Chi-square over 4 tokens: the first emitted token is distributed as the target's p."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.10])
    q = torch.tensor([0.05, 0.05, 0.2, 0.7]) if quality == "bad" else torch.tensor([0.45, 0.3, 0.15, 0.10])
    g = torch.Generator().manual_seed(0)
    n, counts = 20000, torch.zeros(4)
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=g)
        accepted, nxt = accept_draft(x, q[None], torch.stack([p, p]), g)
        counts[int(x) if accepted else nxt] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, f"chi2={chi2:.1f} (p < 0.001 at 3 dof)"


def test_recipe_dtype_resolution():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_finished_sequences_free_slots_for_waiting_ones():
    from mtp_train.runtime.engine import Engine

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (5, 9, 14, 3, 11)]
    params = [SamplingParams(max_new_tokens=m, stop_token_ids=()) for m in (3, 9, 5, 12, 2)]
    wide = Engine.from_pretrained(TINY_TARGET)
    narrow = Engine.from_pretrained(TINY_TARGET, max_seqs=2, max_batch_tokens=16)
    ref = [r.tokens for r in wide.generate(prompts, params)]
    out = narrow.generate(prompts, params)
    assert [r.tokens for r in out] == ref
    assert [len(r.tokens) for r in out] == [3, 9, 5, 12, 2]
    assert narrow.allocator.num_free == narrow.allocator.num_pages


@pytest.mark.parametrize("kind", ["packed", "transposed"])
def test_the_small_batch_layout_changes_the_layout_only(kind):
    """On CPU the engine keeps copies of the weights that multiply faster so at decode sizes; the products are the
    stored layout's up to rounding, rows that require grad keep F.linear, the state dict is untouched, and the
    option turns it off."""
    import torch.nn.functional as F

    from mtp_train.models.parts import Linear
    from mtp_train.runtime import small_batch

    engine = Engine.from_pretrained(TINY_TARGET, small_batch_layout=False)
    keys = set(engine.model.state_dict())
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    make = small_batch.PackedWeight if kind == "packed" else small_batch._transposed
    for m in linears:  # force every shape's copy, whatever this machine measured, to test the path itself
        m.small_rows = dict.fromkeys((1, 2, 3), make(m.weight))
    for m in linears:
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, m.weight.shape[1])
            assert torch.allclose(m(x), F.linear(x, m.weight, m.bias), atol=1e-5)
    graded = torch.randn(2, linears[0].weight.shape[1], requires_grad=True)
    linears[0](graded).sum().backward()
    assert graded.grad is not None
    assert set(engine.model.state_dict()) == keys
    chosen = small_batch.tune(Engine.from_pretrained(TINY_TARGET, small_batch_layout=False).model, kind)
    assert all(set(rows) <= set(range(1, small_batch.MAX_ROWS + 1)) for rows in chosen.values())
    plain = Engine.from_pretrained(TINY_TARGET, small_batch_layout=False)
    assert plain.small_batch == {} and all(not m.small_rows for m in plain.model.modules() if isinstance(m, Linear))


def test_score_never_takes_the_timed_copies(monkeypatch):
    """The small-row copies are chosen by timing, per process, so another process may multiply the same rows
    another way; ``score`` (the features, offline and online) runs torch's ops alone, by the stored weights and
    op by op, whatever copies the Linears and layers hold, and decoding outside it still takes them."""
    import torch.nn.functional as F

    from mtp_train.models.parts import Linear
    from mtp_train.models.transformer import DecoderLayer
    from mtp_train.runtime.attention import TorchStep

    def one_call(*args):
        raise AssertionError("a one-call layer ran")

    monkeypatch.setattr(TorchStep, "run_layer", one_call)

    engine = Engine.from_pretrained(TINY_TARGET, small_batch_layout=False)
    sequences = [list(range(5, 40)), list(range(100, 110))]  # 45 rows, and a last logits chunk of few rows
    before = engine.score(sequences, layers=[0, -1], topk=8)
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    for m in linears:  # a copy whose products are visibly off, at every small row count
        m.small_rows = dict.fromkeys(range(1, 65), lambda x, w=m.weight: F.linear(x, w) + 1e-3)
    for layer in engine.model.modules():
        if isinstance(layer, DecoderLayer):
            layer.decode_weights = "packed"
    after = engine.score(sequences, layers=[0, -1], topk=8)
    for name in ("cu_seqlens", "hidden", "topk_logprobs", "topk_ids", "logsumexp", "tail_logprob"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name
    x = torch.randn(3, linears[0].weight.shape[1])
    assert not torch.equal(linears[0](x), F.linear(x, linears[0].weight, linears[0].bias)), "the copy is used outside"
    with pytest.raises(AssertionError, match="one-call"):
        engine.generate([sequences[1]], SamplingParams(max_new_tokens=2))


def test_a_killed_kernel_build_never_blocks_the_next(tmp_path):
    """A process killed while torch's builder held its directory leaves a ``lock`` that made every later process
    wait forever: a finished build is now loaded without consulting any lock, an unfinished directory is rebuilt
    (a scratch directory renamed into place), and an hour-old scratch directory of a killed build is removed."""
    import os
    import time

    from mtp_train.runtime import small_rows

    built = small_rows.library(small_rows.kernel_dir())
    done = tmp_path / "done"
    done.mkdir()
    (done / small_rows.LIBRARY).write_bytes(built.read_bytes())
    (done / "lock").touch()
    start = time.monotonic()
    assert small_rows.library(done) == done / small_rows.LIBRARY
    assert time.monotonic() - start < 1.0, "a finished build was compiled again"

    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "lock").touch()
    (killed / "small_rows.o").write_bytes(b"half")
    stale = tmp_path / "killed.build-old"
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    lib = small_rows.library(killed)
    assert lib == killed / small_rows.LIBRARY and lib.stat().st_size > 10_000
    assert not (killed / "lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "killed"]


def test_the_machine_is_named_and_its_read_bandwidth_measured():
    """Benches and reports name the CPU (its model and the flags the kernels use) and hold decode against the
    measured read bandwidth."""
    from pathlib import Path

    from mtp_train.runtime.machine import FLAGS, cpu_model, describe, read_bandwidth

    model, flags = cpu_model()
    assert model and model in describe() and set(flags) <= set(FLAGS)
    if Path("/proc/cpuinfo").is_file() and "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in flags
    assert read_bandwidth(64 << 20, repeats=1) > 1e8  # any machine reads faster than 100 MB/s
