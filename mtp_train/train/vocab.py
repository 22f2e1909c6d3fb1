"""What an ``eagle3`` head needs from the features before training: its draft vocabulary and its input layers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtp_train.errors import UserError
from mtp_train.heads.eagle3 import aux_layers_for
from mtp_train.models.config import ModelConfig
from mtp_train.features.online import Features


COUNT_TOKENS = 1 << 22  # assistant tokens gathered before each count over the vocabulary


def frequent_tokens(reader: Features, n: int, vocab_size: int, rank: int = 0, world: int = 1,
                    total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``[n]`` ascending target ids of the ``n`` most frequent assistant tokens (``loss_mask`` 1) of the training
    features, ties to the smaller id (ids never seen fill up from 0, as SpecForge pads). The ids are counted over
    the vocabulary once per ``COUNT_TOKENS`` of them, not once per sequence (a 128k-long count each).

    Over ``world`` ranks each counts the sequences of its share of the shards (shard i to rank ``i % world``: an
    online plan encodes a shard's rows to read them, so no shard is encoded twice) and ``total`` sums the counts
    ``[vocab_size]`` int64 over the ranks; every rank then picks the same ids, those of one rank counting alone."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    pending: list[torch.Tensor] = []
    gathered = 0
    shards: dict[str, int] = {}
    mine = [ref for ref in reader.train if shards.setdefault(ref.shard, len(shards)) % world == rank]
    for i, ref in enumerate(mine):
        rows = reader.load(ref)
        pending.append(rows["input_ids"][rows["loss_mask"].bool()])
        gathered += len(pending[-1])
        if gathered >= COUNT_TOKENS or i == len(mine) - 1:
            counts += torch.bincount(torch.cat(pending).long(), minlength=vocab_size)
            pending, gathered = [], 0
    if world > 1 and total is not None:
        counts = total(counts)
    return torch.argsort(counts, descending=True, stable=True)[:n].sort().values


def draft_vocab_size(requested: int | None, vocab_size: int) -> int:
    """``head.draft_vocab``, capped at the target's vocabulary (null: all of it)."""
    return vocab_size if requested is None else min(requested, vocab_size)


def aux_indices(reader: Features, aux_layers: list[int], cfg: ModelConfig) -> tuple[int, ...]:
    """Where the outputs of layers ``k - 1`` (aux ids ``k``) sit among the stored layers; refused, naming them,
    when the features lack any."""
    stored = reader.manifest.layers
    wanted = [k - 1 for k in aux_layers_for(aux_layers, cfg)]
    missing = [w for w in wanted if w not in stored]
    if missing:
        raise UserError(f"{reader.root}: the features hold the outputs of layers {stored}; the eagle3 head reads "
                        f"those of layers {wanted} (head.aux_layers {[w + 1 for w in wanted]}) and {missing} are "
                        "missing; run `mtp-train precompute` again with this recipe (it stores them)")
    return tuple(stored.index(w) for w in wanted)
