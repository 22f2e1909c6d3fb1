"""Two ranks under DDP (gloo), one of which draws a batch with nothing to train: every head kind's loss still runs its
forward through the DDP wrapper on that rank, so both ranks join the same all-reduce and end the step with the same
gradients, the other rank's half. Before, dflash's loss (no anchor) and the unrolled losses (no document of 3
tokens) returned before any forward, and the ranks' all-reduces no longer matched; DDP's broadcast of the buffers at
each forward did the same whenever a rank's batch ran fewer unrolled steps."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe
from mtp_train.train.data import Batch
from mtp_train.train.distributed import make_accelerator
from mtp_train.train.loss import LossWeights
from mtp_train.train.objective import objective

VOCAB, HIDDEN, K, TOKENS = 97, 32, 8, 60
KINDS = ["mtp", "eagle", "eagle3", "dflash"]
TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


def _batch(kind: str, seed: int, nothing: str | None) -> Batch:
    """A packed batch; ``nothing``: ``"prompt"`` (no loss position) or ``"short"`` (answered documents of one token,
    too short to train a step on)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(TOKENS, generator=g) < 0.7 if nothing is None else torch.full((TOKENS,), nothing == "short")
    cu = list(range(TOKENS + 1)) if nothing == "short" else [0, 25, TOKENS]
    aux = kind in ("eagle3", "dflash")
    return Batch(torch.randint(0, VOCAB, (TOKENS,), generator=g), torch.randn(TOKENS, HIDDEN, generator=g), mask,
                 torch.randn(TOKENS, K, generator=g).log_softmax(-1), torch.randint(0, VOCAB, (TOKENS, K), generator=g),
                 torch.full((TOKENS,), -3.0), cu, torch.randn(TOKENS, 3 * HIDDEN, generator=g) if aux else None)


def _parts(kind: str):
    cfg = ModelConfig("llama", VOCAB, HIDDEN, 48, 1, 4, 2, 8, 1e-6, 128)
    torch.manual_seed(0)
    aux = kind in ("eagle3", "dflash")
    head = build_head(head_spec(kind, 1, cfg, "x", aux_layers=(1, 1, 1) if aux else (), block_size=4,
                                mask_token_id=3, draft_vocab=VOCAB if kind == "eagle3" else 0))
    frozen = FrozenTarget(cfg, torch.randn(VOCAB, HIDDEN), 1 + 0.1 * torch.randn(HIDDEN), torch.randn(VOCAB, HIDDEN))
    return head, frozen


def _grads(head: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in head.parameters() if p.requires_grad])


def _rank(rank: int, port: int, nothing: str, out: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # (the group accelerate then finds, with a timeout that turns a hang into a failure)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    accelerator = make_accelerator(load_recipe(TINY))  # the trainer's DDP, as it configures it
    weights = LossWeights(0.1, 1.0, 2, 0.8, "topk")
    try:
        for kind in KINDS:
            head, frozen = _parts(kind)
            trained = _batch(kind, 1, None)
            objective(head, frozen, trained, weights)[0].backward()
            alone = _grads(head)  # rank 0's gradient by itself
            head.zero_grad(set_to_none=True)
            model = accelerator.prepare(head)
            batch = trained if rank == 0 else _batch(kind, 2, nothing)
            loss, _ = objective(head, frozen, batch, weights, forward=model)
            loss.backward()
            both = [torch.empty_like(alone) for _ in range(2)]
            dist.all_gather(both, _grads(head))
            if rank == 0:
                out[kind] = (float((both[0] - both[1]).abs().max()), float((both[0] - alone / 2).abs().max()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nothing", ["prompt", "short"])
def test_a_rank_without_trained_positions_joins_the_all_reduce(nothing, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(_free_port(), nothing, out), nprocs=2, start_method="spawn")
        results = dict(out)
    assert sorted(results) == sorted(KINDS)
    for kind, (between, halved) in results.items():
        assert between == 0.0, f"{kind}: the ranks' gradients differ by {between}"
        assert halved < 1e-6, f"{kind}: not the trained rank's gradient halved ({halved})"
