"""The head before its first optimizer step, built from the trainer's inputs (torch seeded by the caller)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtp_train.features.online import Features
from mtp_train.heads import DraftHead, HeadSpec, build_head
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.checkpoint import read_layer
from mtp_train.train.checkpoint import load_head
from mtp_train.recipe import Recipe
from mtp_train.train.vocab import frequent_tokens


def initial_head(recipe: Recipe, spec: HeadSpec, frozen: FrozenTarget, reader: Features, rank: int = 0,
                 world: int = 1, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DraftHead:
    """An eagle3 head's vocabulary is the most frequent assistant tokens (counted by ``world`` ranks, each its share,
    summed by ``total``: ``frequent_tokens``) and its lm_head starts as their frozen rows; a dflash head's mask vector
    starts as the embedding of the id engines write there; ``init: target_last_layer`` starts an mtp head's layers
    as the target's last layer (not eagle: see HeadConfig.init); ``head.init_from`` starts from that head's weights
    (its draft vocabulary and mask vector included). ``train.freeze_lm_head`` keeps an eagle3 head's lm_head where it
    starts (no gradient, so no optimizer state)."""
    head = _built(recipe, spec, frozen, reader, rank, world, total)
    if recipe.train.freeze_lm_head and spec.kind == "eagle3":
        head.lm_head.weight.requires_grad_(False)
    return head


def _built(recipe: Recipe, spec: HeadSpec, frozen: FrozenTarget, reader: Features, rank: int, world: int,
           total: Callable[[torch.Tensor], torch.Tensor] | None) -> DraftHead:
    if recipe.head.init_from is not None:
        return load_head(recipe.head.init_from, frozen.cfg).train()
    head = build_head(spec)
    if spec.kind == "eagle3":
        ids = frequent_tokens(reader, spec.draft_vocab, frozen.cfg.vocab_size, rank, world, total)
        head.draft_ids.copy_(ids)
        head.lm_head.weight.data.copy_(frozen.lm_head_weight[ids])
    if spec.kind == "dflash":
        head.mask_embedding.data.copy_(frozen.embed_weight[spec.mask_token_id])
    if recipe.head.init == "target_last_layer" and spec.kind == "mtp":
        state = read_layer(recipe.target.path, frozen.cfg.num_layers - 1, list(_layer_suffixes(head)), frozen.cfg)
        for layer in head.layers:
            layer.load_state_dict({k: v for k, v in state.items() if k in layer.state_dict()}, strict=False)
    return head


def _layer_suffixes(head: DraftHead) -> set[str]:
    return {name.split(".", 2)[2] for name in head.state_dict() if name.startswith("layers.")}
