"""A batch with no position to train (a conversation whose answer ``data.max_length`` cut off, alone in its batch)
is a step with zero gradients for every head kind, not a crash in backward (SmolLM2's recipe hit one at step 526
of eagle3's seed 1 over 3.7 epochs)."""

from __future__ import annotations

import pytest
import torch

from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.config import ModelConfig
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights
from mtp_train.train.objective import objective

VOCAB, HIDDEN, K, TOKENS = 97, 32, 8, 60


@pytest.mark.parametrize("kind", ["mtp", "eagle", "eagle3", "dflash"])
def test_a_batch_without_trained_positions_backpropagates_zero_gradients(kind):
    cfg = ModelConfig("llama", VOCAB, HIDDEN, 48, 1, 4, 2, 8, 1e-6, 128)
    torch.manual_seed(0)
    aux = kind in ("eagle3", "dflash")
    head = build_head(head_spec(kind, 1, cfg, "x", aux_layers=(1, 1, 1) if aux else (), block_size=4,
                                mask_token_id=3))
    frozen = FrozenTarget(cfg, torch.randn(VOCAB, HIDDEN), 1 + 0.1 * torch.randn(HIDDEN), torch.randn(VOCAB, HIDDEN))
    batch = Batch(torch.randint(0, VOCAB, (TOKENS,)), torch.randn(TOKENS, HIDDEN),
                  torch.zeros(TOKENS, dtype=torch.bool),  # the prompt only: nothing to learn
                  torch.randn(TOKENS, K).log_softmax(-1), torch.randint(0, VOCAB, (TOKENS, K)),
                  torch.full((TOKENS,), -3.0), [0, TOKENS], torch.randn(TOKENS, 3 * HIDDEN) if aux else None)
    loss, metrics = objective(head, frozen, batch, LossWeights(0.1, 1.0, 2, 0.8, "topk"))
    loss.backward()
    assert float(loss) == 0.0
    assert all(m.count == 0 for m in metrics)
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert grads and all(g is not None and not g.any() for g in grads)
