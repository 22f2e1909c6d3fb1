"""The KV cache's size: from the recipe (GiB), from the GPU's free memory once the weights are loaded, and a
draft's own pool in proportion to its size, so that speculation leaves the target its whole capacity."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET
from fake_cuda import fake_cuda
from mtp_train.errors import UserError
from mtp_train.models.tp import TensorParallel
from mtp_train.recipe import TargetConfig
from mtp_train.runtime.engine import CPU_KV_BYTES, Engine, kv_budget
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.drafters import HeadDrafter
from mtp_train.runtime.speculative import SpeculativeDecoder


def _target(**fields) -> TargetConfig:
    return TargetConfig(path=TINY_TARGET, **fields)


def test_the_budget_comes_from_the_recipe_or_the_gpu(monkeypatch):
    assert kv_budget(_target(kv_cache_gb=1.5), torch.device("cpu")) == int(1.5 * 2**30)
    assert kv_budget(_target(), torch.device("cpu")) == CPU_KV_BYTES
    with fake_cuda(monkeypatch):  # 16 GiB, of which 8 GiB are free once the weights are loaded
        cuda = torch.device("cuda", 0)
        assert kv_budget(_target(gpu_memory_fraction=0.9), cuda) == int(0.9 * 16 * 2**30) - 8 * 2**30
        assert kv_budget(_target(kv_cache_gb=2.0, gpu_memory_fraction=0.9), cuda) == 2 * 2**30
        with pytest.raises(UserError, match="target.gpu_memory_fraction"):
            kv_budget(_target(gpu_memory_fraction=0.4), cuda)


def test_flashinfers_workspaces_are_reserved_before_the_kv_budget(monkeypatch):
    """On a GPU, the engine's FlashInfer workspace (allocated once its pool is sized) and each drafter's come out of
    the fraction's room, so that the pool, the workspaces and what was in use fit the fraction together."""
    import flashinfer_066
    from mtp_train.runtime.engine import reserved_for
    from mtp_train.runtime.reserve import NCCL_BYTES, flashinfer_backend_bytes

    with fake_cuda(monkeypatch):  # 16 GiB, 8 GiB free once the weights are loaded
        flashinfer_066.install(monkeypatch)
        cuda, target = torch.device("cuda", 0), _target(gpu_memory_fraction=0.9, dtype="bfloat16")
        engine = Engine.for_target(target, torch.bfloat16, cuda, TensorParallel())
        pool = engine.allocator.num_pages * 16 * engine.kv.bytes_per_token(engine.cfg, torch.bfloat16, 1)
        assert type(engine.backend).__name__ == "FlashInferAttention"
        assert 8 * 2**30 + pool + flashinfer_backend_bytes() <= int(0.9 * 16 * 2**30)
        assert reserved_for(target, engine.cfg, torch.bfloat16, cuda, 2, drafters=2) == (
            3 * flashinfer_backend_bytes() + NCCL_BYTES)
        assert reserved_for(_target(attention_backend="torch"), engine.cfg, torch.bfloat16, cuda, 1, 2) == 0


def test_the_engine_sizes_its_pages_from_the_recipe():
    small = Engine.for_target(_target(kv_cache_gb=0.01, attention_backend="torch"), torch.float32,
                              torch.device("cpu"), TensorParallel())
    large = Engine.for_target(_target(kv_cache_gb=0.04), torch.float32, torch.device("cpu"), TensorParallel())
    cfg = small.cfg
    page_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert small.allocator.num_pages == int(0.01 * 2**30) // page_bytes
    assert large.allocator.num_pages == int(0.04 * 2**30) // page_bytes


def _head(engine):
    from mtp_train.heads import build_head, head_spec

    torch.manual_seed(0)
    return build_head(head_spec("mtp", 1, engine.cfg, "x"))


def test_a_head_takes_kv_memory_in_proportion_to_its_layers():
    engine = Engine.from_pretrained(TINY_TARGET, num_pages=100)
    drafter = HeadDrafter(engine, _head(engine))
    assert drafter.allocator.num_pages == engine.allocator.num_pages
    target_bytes = engine.kv.k.numel() + engine.kv.v.numel()
    draft_bytes = drafter.kv.k.numel() + drafter.kv.v.numel()
    assert draft_bytes * engine.cfg.num_layers == target_bytes  # one layer of the target's


def test_speculation_leaves_the_target_its_whole_capacity():
    """A request that fills most of the target's KV slots decodes with a draft too (it used to need twice)."""
    engine = Engine.from_pretrained(TINY_TARGET, num_pages=12, max_seqs=1)  # 192 slots
    prompt = list(range(5, 125))  # 120 tokens + 40 new + k + 1 + a page < 192 < twice that
    params = SamplingParams(max_new_tokens=40, stop_token_ids=())
    plain = engine.generate([prompt], params)[0].tokens
    out = SpeculativeDecoder(engine, HeadDrafter(engine, _head(engine)), 3).generate([prompt], params)
    assert out[0].tokens == plain


def test_the_eval_shares_one_budget_between_the_target_and_its_drafts():
    """The eval's target pool and its drafts' pools (a slot each for every slot of the target's) fit the budget
    together: the target takes its bytes per slot over everyone's."""
    from mtp_train.eval.loading import kv_share

    engine = Engine.from_pretrained(TINY_TARGET, num_pages=4)
    heads = [_head(engine), _head(engine)]
    budget = 64 * 2**20
    share = kv_share(budget, engine.cfg, torch.float32, 1, [*heads, torch.zeros(3)])  # a bigram table has no pool
    shared = Engine(engine.model, kv_bytes=share, small_batch_layout=False)
    drafters = [HeadDrafter(shared, head) for head in heads]
    pools = [shared.kv, *(d.kv for d in drafters)]
    used = sum(p.k.numel() * p.k.element_size() + p.v.numel() * p.v.element_size() for p in pools)
    cfg = engine.cfg
    page = shared.allocator.page_size * (cfg.num_layers + 2) * cfg.num_kv_heads * 2 * cfg.head_dim * 4  # all pools
    assert budget - page < used <= budget  # within a page of the budget, never over it
    assert share == budget * cfg.num_layers // (cfg.num_layers + 2)  # two one-layer heads
