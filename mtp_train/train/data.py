"""Token-budget batches of packed feature sequences, in a seeded order that a checkpoint can resume."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precompute.reader import FeatureReader, SequenceRef
from precompute.run import group_by_tokens


@dataclass
class Batch:
    """Packed documents: ``tokens [N]`` int64, ``hidden [N, H]`` float (last layer, pre-norm),
    ``loss_mask [N]`` bool, ``topk_logprobs [N, K]`` float, ``topk_ids [N, K]`` int64, and
    ``cu_seqlens`` (Python list, D+1 offsets). Row t's top-K is the target's distribution of token t+1.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    loss_mask: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    cu_seqlens: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def plan_batches(refs: list[SequenceRef], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices into ``refs`` for each batch of one epoch: a seeded shuffle cut greedily by ``batch_tokens``."""
    order = torch.randperm(len(refs), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    lengths = [min(refs[i].stop - refs[i].start, batch_tokens) for i in order]
    return [[order[j] for j in group] for group in group_by_tokens(lengths, batch_tokens)]


def load_batch(reader: FeatureReader, refs: list[SequenceRef], batch_tokens: int, dtype: torch.dtype) -> Batch:
    """Read and pack ``refs`` (each cut to ``batch_tokens``); the last stored layer is the head's input."""
    parts = [reader.load(r) for r in refs]
    cut = [min(int(p["input_ids"].numel()), batch_tokens) for p in parts]
    cu = [0]
    for n in cut:
        cu.append(cu[-1] + n)

    def cat(name: str, fn) -> torch.Tensor:
        return torch.cat([fn(p[name][:n]) for p, n in zip(parts, cut)])

    k = reader.manifest.topk
    return Batch(
        tokens=cat("input_ids", lambda t: t.long()),
        hidden=cat("hidden", lambda t: t[:, -1].to(dtype)),
        loss_mask=cat("loss_mask", lambda t: t.bool()),
        topk_logprobs=cat("topk_logprobs", lambda t: t.to(dtype)) if k else torch.zeros(cu[-1], 0),
        topk_ids=cat("topk_ids", lambda t: t.long()) if k else torch.zeros(cu[-1], 0, dtype=torch.long),
        cu_seqlens=cu,
    )
