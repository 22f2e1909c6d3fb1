"""The FlashInfer backend's calls, checked on the CPU against flashinfer 0.6.6 written out in torch
(``flashinfer_066.py``) on the fake CUDA device: tree masks packed on the device, masked plans on fa2, and the same
rows as the torch backend for decode, verify, a tree-masked verify and DFlash's non-causal block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashinfer_066
from conftest import TINY_TARGET, sgd_chat_prompts
from fake_cuda import fake_cuda
from mtp_train.runtime.batch import TreeMask, build_batch
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.flashinfer_backend import packed_mask
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.sequence import Sequence


def _tree_meta(prefix: list[int], bits: list[torch.Tensor], page_size: int = 4):
    new = [list(range(b.shape[0])) for b in bits]
    cached = [p for p in prefix]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(bits))]
    return build_batch(new, cached, tables, page_size, torch.device("cpu"), tree=TreeMask(prefix, bits))


def test_a_tree_mask_packs_as_flashinfers_kernel_reads_it():
    g = torch.Generator().manual_seed(0)
    prefix, bits = [3, 0, 7, 5], []
    for q in (4, 1, 5, 3):  # each query sees some of the tree (its own slot always)
        b = torch.rand(q, q, generator=g) < 0.5
        bits.append(b | torch.eye(q, dtype=torch.bool))
    meta = _tree_meta(prefix, bits)
    packed, indptr = packed_mask(meta)
    kv = meta.host_kv_lens.tolist()
    assert indptr.tolist() == np.cumsum([0] + [-(-q * k // 8) for q, k in zip((4, 1, 5, 3), kv)]).tolist()
    for s, (p, b) in enumerate(zip(prefix, bits)):
        dense = torch.cat([torch.ones(b.shape[0], p, dtype=torch.bool), b], 1).reshape(-1).numpy()
        want = np.packbits(dense, bitorder="little")
        assert packed[indptr[s] : indptr[s + 1]].numpy().tolist() == want.tolist(), f"sequence {s}"


def _engine(backend: str) -> Engine:
    return Engine.from_pretrained(TINY_TARGET, dtype=torch.bfloat16, device="cuda", backend=backend, page_size=4,
                                  max_seqs=4)


def _paged_rows(engine: Engine, prompts, continuation, tree: bool) -> torch.Tensor:
    """Two decode steps, then a 3-token verify (a chain-shaped tree with ``tree``), over cached pages."""
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    seqs = [Sequence(i, list(p), params, frozenset(), len(p)) for i, p in enumerate(prompts)]
    rows = []

    def step(new, mask=None):
        scheduled = list(zip(seqs, new))
        engine.reserve(scheduled)
        with torch.no_grad():
            _, hidden, _ = engine.forward(scheduled, (), None, mask)
            return engine.model.logits(hidden).float().log_softmax(-1)

    step(prompts)
    rows += [step([[c[t]] for c in continuation]) for t in range(2)]
    verify = [c[2:] for c in continuation]
    mask = None
    if tree:
        chain = torch.ones(3, 3, dtype=torch.bool).tril().to(engine.device)
        mask = TreeMask([seq.cached for seq in seqs], [chain] * len(seqs))
    rows.append(step(verify, mask))
    for seq in seqs:
        engine.release(seq)
    return torch.cat(rows)


def test_flashinfer_gives_the_torch_backends_rows_over_pages_and_through_a_tree_mask(monkeypatch):
    prompts = [p[:9 + 3 * i] for i, p in enumerate(sgd_chat_prompts(3, 3))]  # lengths across page boundaries
    g = torch.Generator().manual_seed(1)
    continuation = [torch.randint(5, 4000, (5,), generator=g).tolist() for _ in prompts]
    with fake_cuda(monkeypatch):
        flashinfer_066.install(monkeypatch)
        rows = {}
        for backend in ("torch", "flashinfer"):
            engine = _engine(backend)
            rows[backend] = _paged_rows(engine, prompts, continuation, tree=False).cpu()
            rows[f"{backend} tree"] = _paged_rows(engine, prompts, continuation, tree=True).cpu()
        wrappers = flashinfer_066.BatchPrefillWithPagedKVCacheWrapper.instances
    ref = rows["torch"]
    for name in ("flashinfer", "flashinfer tree", "torch tree"):  # within bf16's noise (a wrong mask is far out)
        kl = (ref.exp() * (ref - rows[name])).sum(-1)
        assert (rows[name].argmax(-1) == ref.argmax(-1)).float().mean() > 0.95, name
        assert kl.mean() < 2e-3 and kl.max() < 2e-2, (name, kl)
    plans = {tuple(sorted(set(w.plans))) for w in wrappers if w.plans}
    assert plans == {("fa3",), ("fa2",)}, f"unmasked plans on fa3 alone, masked on fa2 alone: {plans}"


def test_tree_decoding_on_flashinfer_is_lossless_within_the_sync_budget(monkeypatch):
    """A tree of topk 2, depth 2 over 3 sequences at T = 0: the tree verify and each tree draft level plan a
    masked step; the output is plain greedy decoding's, token for token."""
    from mtp_train.heads import build_head, head_spec
    from mtp_train.runtime.drafters import HeadDrafter
    from mtp_train.runtime.syncs import SYNC_BUDGET, most_per_call
    from mtp_train.runtime.tree import TreeShape
    from mtp_train.runtime.tree_decoder import TreeDecoder

    prompts = sgd_chat_prompts(3, 3)
    params = [SamplingParams(max_new_tokens=6, stop_token_ids=(), seed=s) for s in range(3)]
    with fake_cuda(monkeypatch) as mode:
        flashinfer_066.install(monkeypatch)
        engine = _engine("flashinfer")
        plain = [r.tokens for r in engine.generate(prompts, params)]
        torch.manual_seed(0)
        head = build_head(head_spec("mtp", 1, engine.cfg, "random")).to("cuda", torch.bfloat16)
        decoder = TreeDecoder(engine, HeadDrafter(engine, head), TreeShape(2, 2, 4))
        start = len(mode.syncs)
        with most_per_call(decoder, ("_spec_step",), lambda: len(mode.syncs)) as most:
            out = decoder.generate(prompts, params)
        syncs = mode.syncs[start:]
        masked = [w for w in flashinfer_066.BatchPrefillWithPagedKVCacheWrapper.instances if "fa2" in w.plans]
    assert [r.tokens for r in out] == plain
    assert sum(len(r.stats.accepted) for r in out) > 0, "the run made tree steps"
    assert masked and all(set(w.plans) == {"fa2"} for w in masked)
    assert most["_spec_step"] <= SYNC_BUDGET, most
    assert not [s for s in syncs if "pageable" in s], "plans copy only pinned host arrays to the GPU"



def test_dflash_block_on_flashinfer_matches_torch(monkeypatch):
    """The non-causal block plan stays on fa3 and drafts what the torch backend drafts (the same accepted counts),
    the context's write planned before the block on the one wrapper they share."""
    from mtp_train.heads import build_head, head_spec
    from mtp_train.runtime.drafters import head_drafter
    from mtp_train.runtime.speculative import SpeculativeDecoder

    prompts = sgd_chat_prompts(2, 3)
    params = [SamplingParams(max_new_tokens=6, stop_token_ids=(), seed=s) for s in range(2)]
    outs, accepted = {}, {}
    with fake_cuda(monkeypatch):
        flashinfer_066.install(monkeypatch)
        for backend in ("torch", "flashinfer"):
            engine = _engine(backend)
            torch.manual_seed(0)
            spec = head_spec("dflash", 1, engine.cfg, "random", aux_layers=(1, 2, 3), block_size=4, mask_token_id=7)
            head = build_head(spec).to("cuda", torch.bfloat16)
            decoder = SpeculativeDecoder(engine, head_drafter(engine, head), 3)
            results = decoder.generate(prompts, params)
            outs[backend] = [r.tokens for r in results]
            accepted[backend] = [r.stats.accepted for r in results]
            plain = [r.tokens for r in engine.generate(prompts, params)]
        wrappers = flashinfer_066.BatchPrefillWithPagedKVCacheWrapper.instances
    assert outs["flashinfer"] == plain == outs["torch"]
    assert accepted["flashinfer"] == accepted["torch"], "the drafts differ: a block ran on another step's plan"
    assert all(set(w.plans) <= {"fa3"} for w in wrappers if w.plans), "no masked plan in a dflash run"


def test_the_model_fails_where_flashinfer_066_fails(monkeypatch):
    """What the runtime did before: an unpacked mask with the host index arrays (``segment_packbits`` runs on the
    GPU), and a tree on the ``auto`` wrapper (fa3, fixed at its first, unmasked plan, has no custom-mask kernel)."""
    prompts = [p[:10] for p in sgd_chat_prompts(2, 3)]
    continuation = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]]
    with fake_cuda(monkeypatch):
        flashinfer_066.install(monkeypatch)
        engine = _engine("flashinfer")
        bits = [torch.ones(2, 2, dtype=torch.bool).tril().to("cuda")] * 2
        meta = build_batch([[1, 2], [3, 4]], [5, 6], [[0, 1], [2, 3]], 4, torch.device("cuda"),
                           tree=TreeMask([5, 6], bits))
        dense = torch.cat([torch.cat([b.new_ones(2, p), b], 1).reshape(-1) for p, b in zip([5, 6], bits)])
        with pytest.raises(flashinfer_066.KernelError, match="segment_packbits"):
            engine.backend.masked.plan(meta.host_qo_indptr, meta.host_page_indptr, meta.page_indices,
                                       meta.host_last_page_len, 4, 4, 32, 4, custom_mask=dense)
        monkeypatch.setattr(engine.backend, "masked", engine.backend.wrapper)
        with pytest.raises(flashinfer_066.KernelError, match="fa3"):
            _paged_rows(engine, prompts, continuation, tree=True)


def test_every_kernel_the_backend_plans_is_built_before_the_kv_cache_is_sized(monkeypatch):
    with fake_cuda(monkeypatch):
        flashinfer_066.install(monkeypatch)
        engine = _engine("auto")
    assert type(engine.backend).__name__ == "FlashInferAttention"
    assert [b[0] for b in flashinfer_066.BUILT] == ["fa3", "fa2"]
    assert {b[5] for b in flashinfer_066.BUILT} == {engine.cfg.head_dim}


def test_a_node_without_nvcc_falls_back_to_torch_on_auto_and_refuses_flashinfer(monkeypatch, capsys):
    """flashinfer installed, no prebuilt kernels, no nvcc: ``auto`` decodes on the torch backend after one line that
    says so; ``flashinfer`` named is a one-line user error."""
    from mtp_train.errors import UserError
    from mtp_train.runtime import attention

    why = "Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist"
    prompts = sgd_chat_prompts(2, 3)
    with fake_cuda(monkeypatch):
        flashinfer_066.install(monkeypatch, build_error=why)
        monkeypatch.setattr(attention, "_noticed", set())
        engine = _engine("auto")
        out = engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=()))
        assert type(engine.backend).__name__ == "TorchAttention" and all(len(r.tokens) == 4 for r in out)
        with pytest.raises(UserError, match="flashinfer could not build its kernels") as refused:
            _engine("flashinfer")
    line = "runtime: flashinfer could not build its kernels (RuntimeError: " + why + "), so attention uses the torch backend"
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert "\n" not in str(refused.value) and "nvcc" in str(refused.value)


def test_a_windowed_tree_step_on_flashinfer_attends_as_the_torch_backend(monkeypatch):
    """A draft's window under a branching tree: a node's window counts from its position (its depth in the tree),
    not its slot, while FlashInfer's ``window_left`` counts from slots; the tree's window therefore goes into its
    mask, and FlashInfer's rows equal the torch backend's. (A chain cannot tell the two apart: its slots are its
    depths.)"""
    from mtp_train.runtime.attention import TorchAttention
    from mtp_train.runtime.flashinfer_backend import FlashInferAttention

    window, heads, kv_heads, dim, page = 6, 4, 2, 32, 4
    bits = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # a root, two
    depths, cached = [0, 1, 1, 2], [20, 13]  # children, a grandchild under the second; two sequences' contexts
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (torch.randn(16, page, kv_heads, dim, generator=g) for _ in range(2))
    rows = {}
    with fake_cuda(monkeypatch):
        flashinfer_066.install(monkeypatch)
        dev = torch.device("cuda")
        positions = torch.tensor([c + d for c in cached for d in depths], device=dev)
        meta = build_batch([list(range(4))] * 2, cached, [list(range(8)), list(range(8, 16))], page, dev,
                           positions=positions, tree=TreeMask(cached, [bits.to(dev)] * 2))
        for name, backend in (("torch", TorchAttention(window)), ("flashinfer", FlashInferAttention(dev, window))):
            caches = [c.to(dev, torch.bfloat16) for c in (k_cache, v_cache)]
            step = backend.plan(meta, heads, kv_heads, dim)
            rows[name] = step.attend(*(t.to(dev, torch.bfloat16) for t in (q, k, v)), *caches).float().cpu()
    assert (rows["flashinfer"] - rows["torch"]).abs().max() < 2e-2
