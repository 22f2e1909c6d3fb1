"""``range_attention``, the training attention of eagle3, dflash and MLA heads: the same outputs and gradients as
the dense-mask SDPA they replace (kept here as the reference), a few query rows at a time, and what it keeps for
backward is q, k and v only: no score matrix, whatever the documents' lengths."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from mtp_train.heads import attention
from mtp_train.heads.attention import DocumentCausalAttention, KeyRanges, causal_ranges, range_attention
from mtp_train.train.ttt import TTTAttention

CU = [0, 7, 30, 64]
HQ, HKV, D = 4, 2, 8


class DenseTTT:
    """Training-time test's attention as it was: per document, SDPA over every step's keys with a dense mask
    (causal over the step-0 keys, the diagonal of each later step's)."""

    def __init__(self, cu_seqlens: list[int]) -> None:
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        parts = []
        for s, e in self.bounds:
            n = e - s
            eye = torch.eye(n, dtype=torch.bool)
            mask = torch.cat([torch.ones(n, n, dtype=torch.bool).tril()] + [eye] * (len(self.keys) - 1), dim=1)
            keys, values = (torch.cat([t[s:e] for t in ts]) for ts in (self.keys, self.values))
            parts.append(F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2),
                attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(parts)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so that every test crosses chunk and document boundaries."""
    monkeypatch.setattr(attention, "SCORE_CHUNK_BYTES", HQ * 4 * 8 * 32)  # 8 rows over 32 keys


def _grads(outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
    return list(torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), leaves))


def test_training_time_test_equals_the_dense_mask_forward_and_backward(small_chunks):
    assert len(causal_ranges(CU).chunks(HQ, 2)) > len(CU)
    torch.manual_seed(0)
    steps = [[torch.randn(CU[-1], h, D, requires_grad=True) for h in (HQ, HKV, HKV)] for _ in range(3)]
    leaves = [t for step in steps for t in step]
    results = []
    for plan in (DenseTTT(CU), TTTAttention(CU)):
        outs = [plan.attend(q * 1, k * 1, v * 1) for q, k, v in steps]  # (* 1: each plan its own graph)
        results.append((outs, _grads(outs, leaves)))
    (want, want_grads), (got, got_grads) = results
    for g, w in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_mla_latent_attention_equals_sdpa_forward_and_backward(small_chunks):
    torch.manual_seed(0)
    q, latent = torch.randn(CU[-1], HQ, 20, requires_grad=True), torch.randn(CU[-1], 1, 20, requires_grad=True)
    want = torch.cat([F.scaled_dot_product_attention(
        q[None, s:e].transpose(1, 2), latent[None, s:e].transpose(1, 2), latent[None, s:e, :, :12].transpose(1, 2),
        is_causal=True, enable_gqa=True, scale=0.3)[0].transpose(0, 1) for s, e in zip(CU[:-1], CU[1:])])
    got = DocumentCausalAttention(CU).attend_latent(q, latent, None, 12, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads([got], [q, latent]), _grads([want], [q, latent])):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_it_keeps_q_k_and_v_only_and_computes_in_float32_under_bf16_autocast():
    """What autograd keeps for two training-time-test steps: each step's q, k and v, whatever the length (the dense
    mask's SDPA kept the [heads, L, 2L] scores, their softmax and the mask)."""
    n = 300
    steps = [[torch.randn(n, h, D, requires_grad=True) for h in (HQ, HKV, HKV)] for _ in range(2)]
    plan, saved = TTTAttention([0, n]), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
        out = [plan.attend(*step) for step in steps][-1]
    kept = {t.untyped_storage()._cdata for t in (r() for r in saved) if t is not None}
    assert kept == {t.untyped_storage()._cdata for step in steps for t in step}
    (_, k0, v0), (q, k, v) = steps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = range_attention(*(t.bfloat16() for t in (q, k0, v0)), causal_ranges([0, n]),
                               [(k.bfloat16(), v.bfloat16())])
    assert half.dtype == torch.bfloat16  # as SDPA returns under autocast; the softmax itself in float32
    torch.testing.assert_close(half.float(), out, rtol=0.05, atol=0.05)


def test_chunks_cover_every_row_in_whole_groups_within_the_budget(small_chunks):
    lo = [0] * 10 + [10] * 15
    hi = [1 + i // 5 * 5 + 4 for i in range(10)] + [10 + 1 + i // 5 * 5 + 4 for i in range(15)]
    ranges = KeyRanges(lo, hi, group=5)
    chunks = ranges.chunks(HQ, 5)
    assert chunks[0][0] == 0 and chunks[-1][1] == 25 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all((r1 - r0) % 5 == 0 for r0, r1 in chunks)
    assert all((r1 - r0) * HQ * (hi[r1 - 1] - lo[r0] + 5) * 4 <= attention.SCORE_CHUNK_BYTES or r1 - r0 == 5
               for r0, r1 in chunks)


def test_chunks_pack_whole_documents_only_while_masked_scores_stay_bounded(small_chunks, monkeypatch):
    """Many short packed documents: no chunk scores more than twice what its documents score alone (one chunk over
    all of them would score every row against every document's keys), and documents are packed, not one per chunk,
    where that bound allows."""
    monkeypatch.setattr(attention, "SCORE_CHUNK_BYTES", 2**30)
    cu = list(range(0, 40 * 30 + 1, 30))  # 40 documents of 30 tokens
    ranges = causal_ranges(cu)
    chunks = ranges.chunks(HQ, 2)
    assert chunks[0][0] == 0 and chunks[-1][1] == cu[-1] and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    alone = {s: ranges._cost(s, e, HQ, 2) for s, e in zip(cu, cu[1:])}
    for r0, r1 in chunks:
        assert r0 in alone and (r1 in alone or r1 == cu[-1])  # whole documents
        assert ranges._cost(r0, r1, HQ, 2) <= 2 * sum(c for s, c in alone.items() if r0 <= s < r1)
    assert 1 < len(chunks) < len(cu) - 1
