"""Inference-validated validation: the trainer's metrics, computed by the runtime's target and head.

The held-out sequences of the features are scored again by the runtime's target (``Engine.score``: fp32
hidden states and top-K, where the trainer read the stored bf16 features; FP8 features' hidden states go through
the same FP8 round trip, whose cost the bf16-against-fp8 comparison measures apart), and the head runs through the
runtime's paged-KV attention (``DraftHead.run`` with a step plan, as in speculative decoding) instead of
the trainer's document-causal attention. The loss and the top-1 accuracy per unrolled step are then
aggregated by the trainer's own ``validate`` and compared with what the trainer reported for the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mtp_train.heads.frozen import FrozenTarget
from mtp_train.runtime.batch import build_batch
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.kv_cache import PageTable
from mtp_train.runtime.drafters import HeadDrafter
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights
from mtp_train.train.objective import validate
from mtp_train.features.online import Features
from mtp_train.features.tensors import read_back


def runtime_frozen(engine: Engine) -> FrozenTarget:
    """The frozen parts as the runtime holds them (its embedding, final norm and lm_head)."""
    m = engine.model
    return FrozenTarget(engine.cfg, m.tok_embeddings.weight, m.norm.weight, m.output.weight)


def runtime_batches(engine: Engine, reader: Features, aux: tuple[int, ...] = ()) -> Iterator[Batch]:
    """The held-out sequences (16 per batch, as the trainer groups them), re-scored by the runtime's target, with
    the outputs of layers ``aux`` as ``Batch.aux``."""
    refs = reader.heldout
    topk, stored = reader.manifest.topk, reader.manifest.hidden_dtype
    for i in range(0, len(refs), 16):
        parts = [reader.load(r) for r in refs[i : i + 16]]
        seqs = [p["input_ids"].long().tolist() for p in parts]
        out = engine.score(seqs, layers=[*aux, -1], topk=topk)
        # FP8 features: the same round trip as the trainer's inputs, so that a gap is the implementation's
        hidden = out.hidden if stored == "bfloat16" else read_back(out.hidden, stored)
        yield Batch(
            tokens=torch.cat([p["input_ids"].long() for p in parts]),
            hidden=hidden[:, -1].float(),
            loss_mask=torch.cat([p["loss_mask"].bool() for p in parts]),
            topk_logprobs=out.topk_logprobs.float(),
            topk_ids=out.topk_ids.long(),
            tail_logprob=out.tail_logprob.float(),
            cu_seqlens=out.cu_seqlens.tolist(),
            aux=hidden[:, :-1].flatten(1).float() if aux else None,
        )


def paged_forward(drafter: HeadDrafter):
    """The head's forward over packed documents through the runtime's paged K/V and attention backend."""
    alloc = drafter.allocator

    def forward(embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cu: list[int]) -> torch.Tensor:
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        tables = [PageTable() for _ in lengths]
        try:
            for table, n in zip(tables, lengths):
                alloc.reserve(table, n)
            meta = build_batch([[0] * n for n in lengths], [0] * len(lengths), [t.pages for t in tables],
                               alloc.page_size, embeds.device)
            plan = drafter.backend.plan(meta, *drafter.heads)
            return drafter.head.run(embeds, hidden, positions, plan, drafter.kv.layers)
        finally:
            for table in tables:
                alloc.free(table)

    return forward


@torch.inference_mode()
def runtime_validation(engine: Engine, drafter: HeadDrafter, reader: Features, weights: LossWeights) -> dict:
    """``{"val_loss": [...], "val_top1": [...], ...}`` per unrolled step, by the runtime's implementations.

    Under tensor parallelism every rank scores (a collective forward) and only the leader, which holds the
    head, computes the metrics; the other ranks return ``{}``.
    """
    batches = runtime_batches(engine, reader, drafter.capture)
    if not drafter.leader:
        for _ in batches:
            pass
        return {}
    # An eagle3 head's later steps attend to earlier steps' keys at their own row (training-time test), which no
    # paged step plan expresses; a dflash head's blocks see context before their anchors only, which a paged step
    # holds for one anchor at a time (tests/test_dflash.py checks that one against training blocks). Both are
    # validated over the runtime's target states with their training attention.
    forward = None if drafter.head.spec.kind in ("eagle3", "dflash") else paged_forward(drafter)
    return validate(drafter.head, runtime_frozen(engine), batches, weights, forward=forward)
