"""D-PACE (``train.dpace_alpha``): a dflash head's block positions weighted by the derivative of the smoothed expected
accepted length, per block, in place of ``unroll_decay``'s fixed weights."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_RECIPE, TINY_TARGET
from mtp_train.errors import UserError
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.blocks import block_loss, dpace_weights
from mtp_train.train.loss import LossWeights


def _naive(probs: list[float], counted: list[bool], alpha: float) -> list[float]:
    """Position j: the sum over counted m >= j of the product over i <= m of s_i (s_i = 1 where not counted)."""
    s = [(1 - alpha) * p + alpha if c else 1.0 for p, c in zip(probs, counted)]
    out = []
    for j in range(len(s)):
        if not counted[j]:
            out.append(0.0)
            continue
        total = 0.0
        for m in range(j, len(s)):
            if counted[m]:
                prod = 1.0
                for i in range(m + 1):
                    prod *= s[i]
                total += prod
        out.append(total)
    return out


def test_the_weights_are_the_expected_accepted_lengths_derivative():
    torch.manual_seed(0)
    probs = torch.rand(6, 5)
    counted = torch.rand(6, 5) > 0.3
    for alpha in (0.0, 0.5, 1.0):
        got = dpace_weights(probs, counted, alpha)
        want = torch.tensor([_naive(p.tolist(), c.tolist(), alpha) for p, c in zip(probs, counted)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    every = torch.ones(1, 4, dtype=torch.bool)
    assert dpace_weights(probs[:1, :4], every, 1.0).tolist() == [[4.0, 3.0, 2.0, 1.0]]  # alpha 1: positions left
    sure = dpace_weights(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), every, 0.0)  # a sure miss at position 3
    assert sure.tolist() == [[2.0, 1.0, 0.0, 0.0]]  # ... past which nothing is accepted: no weight there


def test_dpace_weights_the_block_loss_and_keeps_its_metrics(monkeypatch):
    """The loss with D-PACE is the weighted sum of the same per-position KL terms over the blocks (its metrics the
    same as with the decay), and it trains: its gradient differs from the decay's."""
    from test_dflash import _batch, _head

    frozen = FrozenTarget.load(TINY_TARGET)
    head, batch = _head(frozen, 1), _batch(frozen)
    head.train()
    base = LossWeights(0.0, 1.0, 4, 0.8, "topk")
    losses, grads, metrics = {}, {}, {}
    for name, alpha in (("decay", None), ("dpace", 0.5)):
        head.zero_grad()
        loss, metrics[name] = block_loss(head, frozen, batch, LossWeights(0.0, 1.0, 4, 0.8, "topk", dpace=alpha))
        loss.backward()
        losses[name], grads[name] = float(loss.detach()), head.fc.weight.grad.clone()
    assert [(float(m.loss), m.count) for m in metrics["decay"]] == [(float(m.loss), m.count) for m in metrics["dpace"]]
    assert losses["decay"] != pytest.approx(losses["dpace"], rel=1e-3)
    assert not torch.allclose(grads["decay"], grads["dpace"])
    assert base.dpace is None  # the default is the decay


def test_dpace_is_a_dflash_heads_default_and_refused_where_none_trains():
    from mtp_train.recipe import load_recipe

    with pytest.raises(UserError, match="train.dpace_alpha: D-PACE weights a dflash head"):
        load_recipe(TINY_RECIPE, ["train.dpace_alpha=0.5", "head.kind=eagle3", "eval.compare=[]"])
    from mtp_train.train.objective import loss_weights

    dflash = ["head.kind=dflash", "eval.compare=[]", "eval.k=[2]", "eval.trees=[]"]
    assert loss_weights(load_recipe(TINY_RECIPE, ["train.dpace_alpha=0.3", *dflash])).dpace == 0.3
    assert loss_weights(load_recipe(TINY_RECIPE, dflash)).dpace == 0.5  # a dflash head's default
    assert loss_weights(load_recipe(TINY_RECIPE, ["train.dpace_alpha=null", *dflash])).dpace is None  # the decay
    assert loss_weights(load_recipe(TINY_RECIPE, ["head.kind=eagle3", "eval.compare=[]"])).dpace is None  # ignored
