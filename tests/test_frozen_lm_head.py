"""The frozen lm_head under bf16 autocast: one bf16 copy for training, not a fresh ``[vocab, H]`` cast for every chunk
of the loss in forward and again in backward's recomputation; the same logits, losses and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.config import ModelConfig
from mtp_train.train import loss as loss_mod
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights
from mtp_train.train.objective import objective

VOCAB, HIDDEN, K, TOKENS = 97, 32, 8, 120


class _Casts(TorchDispatchMode):
    """Counts the casts of a ``[VOCAB, HIDDEN]`` float32 tensor to a half dtype (the lm_head's; nothing else has
    that shape here)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and isinstance(source, torch.Tensor)
                and tuple(source.shape) == (VOCAB, HIDDEN) and source.dtype == torch.float32
                and kwargs.get("dtype") in (torch.bfloat16, torch.float16)):
            self.count += 1
        return func(*args, **kwargs)


class _CastEachCall(FrozenTarget):
    """The lm_head as autocast treats a buffer: cast again at every call (the reference)."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lm_head_weight).float()


def _setup(kind: str):
    cfg = ModelConfig("llama", VOCAB, HIDDEN, 48, 1, 4, 2, 8, 1e-6, 128)
    torch.manual_seed(0)
    head = build_head(head_spec(kind, 1, cfg, "x", aux_layers=(1, 1, 1) if kind == "dflash" else (),
                                block_size=4, mask_token_id=3))
    parts = (torch.randn(VOCAB, HIDDEN), 1 + 0.1 * torch.randn(HIDDEN), torch.randn(VOCAB, HIDDEN))
    cu = [0, 50, 90, TOKENS]
    batch = Batch(torch.randint(0, VOCAB, (TOKENS,)), torch.randn(TOKENS, HIDDEN), torch.rand(TOKENS) < 0.8,
                  torch.randn(TOKENS, K).log_softmax(-1), torch.randint(0, VOCAB, (TOKENS, K)),
                  torch.full((TOKENS,), -3.0), cu, torch.randn(TOKENS, 3 * HIDDEN) if kind == "dflash" else None)
    return cfg, head, parts, batch


def _step(head, frozen, batch, weights):
    """One step under CPU bf16 autocast, backward outside it as the trainer runs it: the loss and the gradients."""
    head.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = objective(head, frozen, batch, weights)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in head.parameters()]


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_the_lm_head_is_cast_once_not_per_chunk(monkeypatch, kind):
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", VOCAB * 4 * 16)  # 16 rows per vocabulary chunk: several chunks
    cfg, head, parts, batch = _setup(kind)
    weights = LossWeights(0.1, 1.0, 3, 0.8, "topk")
    frozen = FrozenTarget(cfg, *parts)
    counts, results = [], []
    for _ in range(2):
        with _Casts() as casts:
            results.append(_step(head, frozen, batch, weights))
        counts.append(casts.count)
    assert counts == [1, 0], counts  # once for the run; per chunk (forward and recompute) before
    reference = _step(head, _CastEachCall(cfg, *parts), batch, weights)
    for got in results:  # the copy holds what each cast made: the same bits
        assert torch.equal(got[0], reference[0])
        for g, w in zip(got[1], reference[1]):
            assert torch.equal(g, w)


def test_the_copy_is_remade_after_the_weight_moves():
    cfg, _, parts, _ = _setup("mtp")
    frozen = FrozenTarget(cfg, *parts)
    x = torch.randn(5, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = frozen.logits(x)
    assert set(frozen._half) == {torch.bfloat16}
    frozen.to("cpu")  # any _apply (to, cuda, float...) drops the copies: they were of the weight as it was
    assert frozen._half == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(frozen.logits(x), first)
    assert torch.equal(frozen.half_lm_head(torch.bfloat16), frozen.lm_head_weight.to(torch.bfloat16))
