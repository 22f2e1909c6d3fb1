"""Which of the target's decoder layers the features store: precompute writes them, the memory plan sizes them."""

from __future__ import annotations

from mtp_train.heads.base import AUX_KINDS
from mtp_train.heads.eagle3 import aux_layers_for
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe


def stored_layers(recipe: Recipe, cfg: ModelConfig) -> list[int]:
    """The decoder layers whose outputs precompute stores, ascending, the last layer last: ``precompute.layers``
    and, when an ``eagle3`` or ``dflash`` head is trained (``head.kind`` or ``eval.compare``), the layers it reads
    (the outputs of layers ``k - 1`` for its aux ids ``k``)."""
    ids = {lid % cfg.num_layers for lid in recipe.precompute.layers} | {cfg.num_layers - 1}
    return sorted(ids | set(eagle3_layers(recipe, cfg)))


def eagle3_layers(recipe: Recipe, cfg: ModelConfig) -> list[int]:
    """Outputs of these layers are what an ``eagle3`` or ``dflash`` head of the recipe reads (none when it trains
    neither)."""
    if not set(AUX_KINDS) & {recipe.head.kind, *recipe.eval.compare}:
        return []
    return [k - 1 for k in aux_layers_for(recipe.head.aux_layers, cfg)]
