"""Host syncs per decode step, counted on the fake CUDA device (``fake_cuda.FakeCudaMode.syncs``).

Each sync stalls a real GPU's queue until the host has caught up, so a speculative step must cost a fixed few
whatever the batch and k: ``SYNC_BUDGET`` per speculative step and per plain step (``mtp_train.runtime.syncs``
counts the same way on a real GPU). Sampling and acceptance stay on the device, and a MoE layer makes no sync.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import REPO, TINY_TARGET, sgd_chat_prompts
from fake_cuda import fake_cuda
from mtp_train.models.checkpoint import load_transformer
from mtp_train.runtime.drafters import DraftModelDrafter, HeadDrafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams, sample, target_distribution
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.runtime.syncs import SYNC_BUDGET, most_per_call

DEEPSEEK_TARGET = REPO / "recipes" / "tiny-deepseek" / "target"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return sgd_chat_prompts(8, 4)


def _params(temperature: float, n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_new_tokens=6, stop_token_ids=(), seed=s) for s in range(n)]


def _random_head(engine: Engine):
    from mtp_train.heads import build_head, head_spec

    torch.manual_seed(0)
    return build_head(head_spec("mtp", 1, engine.cfg, "random"))


@pytest.mark.parametrize("draft", ["mtp", "draft_target"])
@pytest.mark.parametrize("batch,k,temperature", [(1, 1, 0.0), (1, 4, 0.0), (8, 1, 0.0), (8, 4, 0.0), (8, 4, 1.0)])
def test_a_speculative_step_makes_at_most_three_host_syncs(monkeypatch, prompts, draft, batch, k, temperature):
    with fake_cuda(monkeypatch) as mode:
        engine = Engine.from_pretrained(TINY_TARGET, device="cuda", page_size=16, max_seqs=batch)
        drafter = (HeadDrafter(engine, _random_head(engine)) if draft == "mtp" else
                   DraftModelDrafter(engine, load_transformer(TINY_TARGET, device="cuda")))
        decoder = SpeculativeDecoder(engine, drafter, k)
        start = len(mode.syncs)
        with most_per_call(decoder, ("_spec_step", "_plain_step"), lambda: len(mode.syncs)) as most:
            out = decoder.generate(prompts[:batch], _params(temperature, batch))
    assert sum(len(r.stats.accepted) for r in out) > 0, "the run made speculative steps"
    seen = dict(Counter(mode.syncs[start:]))
    assert most["_spec_step"] <= SYNC_BUDGET, f"{most['_spec_step']} syncs in a speculative step; the run's: {seen}"
    assert most["_plain_step"] <= SYNC_BUDGET, f"{most['_plain_step']} syncs in a prefill step; the run's: {seen}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_step_makes_at_most_three_host_syncs(monkeypatch, prompts, temperature):
    """A tree of topk 4, depth 3 over 8 sequences: drafting, pruning, the tree-masked verify, acceptance and the
    K/V move stay on the device."""
    from mtp_train.runtime.tree import TreeShape
    from mtp_train.runtime.tree_decoder import TreeDecoder

    with fake_cuda(monkeypatch) as mode:
        engine = Engine.from_pretrained(TINY_TARGET, device="cuda", page_size=16, max_seqs=8)
        decoder = TreeDecoder(engine, HeadDrafter(engine, _random_head(engine)), TreeShape(4, 3, 8))
        start = len(mode.syncs)
        with most_per_call(decoder, ("_spec_step",), lambda: len(mode.syncs)) as most:
            out = decoder.generate(prompts, _params(temperature, 8))
    assert sum(len(r.stats.accepted) for r in out) > 0, "the run made tree steps"
    seen = dict(Counter(mode.syncs[start:]))
    assert most["_spec_step"] <= SYNC_BUDGET, f"{most['_spec_step']} syncs in a tree step; the run's: {seen}"


@pytest.mark.parametrize("target", [TINY_TARGET, DEEPSEEK_TARGET], ids=["llama", "deepseek"])
@pytest.mark.parametrize("batch,temperature", [(1, 0.0), (8, 0.0), (8, 1.0)])
def test_a_plain_step_makes_at_most_three_host_syncs(monkeypatch, prompts, target, batch, temperature):
    """Prefill and decode steps alike; the DeepSeek target's MoE layers included."""
    with fake_cuda(monkeypatch) as mode:
        engine = Engine.from_pretrained(target, device="cuda", page_size=16, max_seqs=batch)
        start = len(mode.syncs)
        with most_per_call(engine, ("step",), lambda: len(mode.syncs)) as most:
            engine.generate(prompts[:batch], _params(temperature, batch))
    assert most["step"] <= SYNC_BUDGET, f"{most['step']} syncs in a step; the run's: {dict(Counter(mode.syncs[start:]))}"


def test_the_counter_sees_each_kind_of_sync(monkeypatch):
    """The harness itself: reads, pageable copies and data-dependent shapes count; pinned non-blocking copies and
    device-side work do not."""
    with fake_cuda(monkeypatch) as mode:
        x = torch.arange(6.0, device="cuda")
        y = (x * 2).softmax(0).cumsum(0)
        assert mode.syncs == []
        z = torch.ones(3).pin_memory().to("cuda", non_blocking=True)
        assert mode.syncs == [] and z.device.type == "cuda"
        float(y[-1]), y.tolist(), y.cpu(), torch.ones(3).to("cuda"), x[torch.tensor([0, 1])], x[x > 2]
        torch.bincount(x.long())
        torch.cuda.synchronize()
    assert len(mode.syncs) == 8, mode.syncs


def test_sampling_stays_on_the_device_and_follows_the_distribution(monkeypatch):
    """A batch of rows with different settings is drawn on the device without a sync; each request's seed fixes
    its draws; over many seeds a row's tokens follow its distribution (chi-square at p = 0.001)."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=1.0, seed=0), SamplingParams(), SamplingParams(temperature=0.7, top_k=3)]
    trials, counts = 3000, torch.zeros(3, 6)
    with fake_cuda(monkeypatch) as mode:
        on_gpu = logits.to("cuda")
        start = len(mode.syncs)
        for seed in range(trials):
            gens = [torch.Generator().manual_seed(seed), None, torch.Generator().manual_seed(10**6 + seed)]
            tokens = sample(on_gpu, params, gens)
            assert tokens.device.type == "cuda"
            counts[torch.arange(3), tokens.cpu()] += 1
        assert len(mode.syncs) - start == trials, "one sync per draw: the test's own read of the tokens"
    again = [sample(logits, params, [torch.Generator().manual_seed(s), None, torch.Generator().manual_seed(10**6 + s)])
             for s in (0, 0)]
    assert torch.equal(again[0], again[1]), "a seed fixes the draws"
    assert counts[1, logits[1].argmax()] == trials, "a greedy row is its argmax"
    for row in (0, 2):
        expected = target_distribution(logits[row : row + 1], params[row])[0] * trials
        cells = expected > 0
        chi2 = float(((counts[row, cells] - expected[cells]) ** 2 / expected[cells]).sum())
        assert counts[row, ~cells].sum() == 0, "a token outside top-k is never drawn"
        assert chi2 < {5: 20.515, 2: 13.816}[int(cells.sum()) - 1], (row, chi2, counts[row].tolist())


def test_moe_makes_no_sync_and_matches_the_loop_over_experts(monkeypatch):
    """The grouped expert matmuls against the loop over the experts (the former computation), at decode and
    prefill sizes, and no sync on the device."""
    model = load_transformer(DEEPSEEK_TARGET)
    moe = model.layers[1].feed_forward
    with torch.no_grad():
        for tokens in (1, 8, 40, 300):
            x = torch.randn(tokens, model.cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
            weights, ids = moe.router(x)
            flat = ids.view(-1)
            order = flat.argsort(stable=True)
            rows = x.index_select(0, order // ids.shape[1])
            assert moe._can_group(x)
            torch.testing.assert_close(moe._grouped(rows, flat), moe._looped(rows, flat), rtol=1e-5, atol=1e-6)
        with fake_cuda(monkeypatch) as mode:
            moe.to("cuda")
            x = x.to("cuda")
            start = len(mode.syncs)
            out = moe(x)
            assert mode.syncs[start:] == [] and out.device.type == "cuda"



@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts a real GPU's syncs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_real_gpu_step_makes_at_most_three_host_syncs(prompts, dtype):
    """The same budget counted by torch's sync debug mode (``runtime.syncs``), FlashInfer's plan included in bf16."""
    from mtp_train.runtime.syncs import cuda_syncs

    engine = Engine.from_pretrained(TINY_TARGET, dtype=dtype, device="cuda", max_seqs=8)
    decoder = SpeculativeDecoder(engine, HeadDrafter(engine, _random_head(engine)), 4)
    decoder.generate(prompts[:2], _params(1.0, 2))  # warm-up: allocations, kernel selection
    with cuda_syncs() as syncs, most_per_call(decoder, ("_spec_step", "_plain_step"), lambda: syncs.count) as most:
        decoder.generate(prompts, _params(1.0, 8))
    with cuda_syncs() as plain, most_per_call(engine, ("step",), lambda: plain.count) as most_plain:
        engine.generate(prompts, _params(0.0, 8))
    assert max(most.values()) <= SYNC_BUDGET, (most, syncs.messages)
    assert most_plain["step"] <= SYNC_BUDGET, (most_plain, plain.messages)


def test_a_rank_that_writes_no_shard_scores_without_copying_to_the_host(monkeypatch, prompts):
    """Under tensor parallelism only the leader writes shards: the other ranks score every batch (taking part in
    its collectives) with ``keep=False``, which copies nothing to the host, where the leader's copies are the
    features (one read per captured tensor and batch)."""
    with fake_cuda(monkeypatch) as mode:
        engine = Engine.from_pretrained(TINY_TARGET, device="cuda", page_size=16, max_batch_tokens=64)
        start = len(mode.syncs)
        kept = engine.score(prompts, layers=[-1], topk=4)
        leader = mode.syncs[start:]
        start = len(mode.syncs)
        assert engine.score(prompts, layers=[-1], topk=4, keep=False) is None
        other = mode.syncs[start:]
    assert kept.hidden.shape[0] == sum(len(p) for p in prompts) and kept.hidden.device.type == "cpu"
    assert len(leader) >= 5 * 2 and other == [], (leader, other)
