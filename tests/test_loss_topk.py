"""The top-K teacher's KL: exact when K covers the vocabulary, a lower bound otherwise, and its tail from fp32."""

from __future__ import annotations

import torch

from mtp_train.train.loss import kl_topk


def _case(n: int = 64, vocab: int = 500, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.log_softmax(3 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    draft = torch.log_softmax(target + torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    return target, draft


def _stored(target: torch.Tensor, k: int, dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What precompute stores: top-K log-probs (bf16 on disk), their ids and the fp32 log of the mass outside them."""
    values, ids = target.topk(k, -1)
    tail = torch.logsumexp(target.scatter(-1, ids, float("-inf")), -1)
    return values.to(dtype), ids, tail.float()


def test_full_k_is_the_exact_kl():
    target, draft = _case()
    exact = (target.exp() * (target - draft)).sum(-1)
    lp, ids, tail = _stored(target, target.shape[-1])
    assert torch.isneginf(tail).all()
    got = kl_topk(draft.float(), lp, ids, tail).double()
    assert (got - exact).abs().max() < 1e-4


def test_topk_kl_is_a_lower_bound_that_tightens_with_k():
    target, draft = _case()
    exact = (target.exp() * (target - draft)).sum(-1)
    gaps = []
    for k in (4, 16, 64, 256):
        got = kl_topk(draft.float(), *_stored(target, k)).double()
        assert (got <= exact + 1e-4).all(), k
        gaps.append(float((exact - got).mean()))
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0] / 4


def test_tail_comes_from_the_stored_fp32_mass_not_from_the_bf16_top_k():
    """A flat tail (mass 0.5 over 400 tokens): 1 - sum(bf16 top-K) is off by bf16 rounding, the stored tail is not."""
    target, draft = _case(n=8)
    lp, ids, tail = _stored(target, 8, torch.bfloat16)
    got = kl_topk(draft.float(), lp, ids, tail)
    wrong_tail = torch.log1p(-lp.float().exp().sum(-1)).clamp(max=-1e-7)
    other = kl_topk(draft.float(), lp, ids, wrong_tail)
    p_top = lp.float().exp().sum(-1)
    assert ((p_top + tail.exp()) - 1).abs().max() > 1e-4, "bf16 rounding makes the stored buckets not sum to 1"
    assert not torch.allclose(got, other, atol=1e-6), "the stored tail is what the loss reads"
    assert torch.isfinite(got).all()
    d = draft.float().clone().requires_grad_(True)
    kl_topk(torch.log_softmax(d, -1), lp, ids, tail).sum().backward()
    assert torch.isfinite(d.grad).all()


def test_the_lk_loss_is_acceptance_where_the_overlap_is_large_and_kl_where_small():
    """``train.loss: lk`` at full K: lam * KL + (1 - lam) * (1 - alpha), alpha the exact acceptance probability
    sum min(p, q) over the vocabulary, lam = exp(-3 alpha) held constant in the gradient; the eagle3 restriction
    to a draft vocabulary holding every id gives the same."""
    from mtp_train.train.ttt import restricted_kl

    target, draft = _case(vocab=300)
    p, q = target.exp(), draft.exp()
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-3 * alpha)
    kl = (p * (target - draft)).sum(-1)
    lp, ids, tail = _stored(target, target.shape[-1])
    logits = draft.float().clone().requires_grad_()
    got = kl_topk(torch.log_softmax(logits, -1), lp, ids, tail, lk=True)
    want = lam * kl + (1 - lam) * (1 - alpha)
    assert (got.double() - want).abs().max() < 1e-4
    assert not torch.allclose(got.double(), kl, atol=1e-3)  # it is not the KL
    grad, = torch.autograd.grad(got.sum(), logits)
    ref = logits.detach().double().clone().requires_grad_()
    qr = torch.softmax(ref, -1)
    manual = (lam * (p * (target - qr.log())).sum(-1) + (1 - lam) * (1 - torch.minimum(p, qr).sum(-1))).sum()
    want_grad, = torch.autograd.grad(manual, ref)
    assert (grad.double() - want_grad).abs().max() < 1e-4
    restricted = restricted_kl(torch.log_softmax(logits.detach(), -1), lp, ids, tail, lk=True)
    assert (restricted.double() - want).abs().max() < 1e-4
