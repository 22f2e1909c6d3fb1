"""The train stage's refusals that the recipe and the target's config decide alone (``mtp_train.pipeline.check_recipe``
makes them before any stage runs), and the head spec a recipe asks for."""

from __future__ import annotations

import torch

from mtp_train.heads import AUX_KINDS, HeadSpec, head_spec
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.train.vocab import draft_vocab_size


def recipe_head_spec(recipe: Recipe, cfg: ModelConfig, fingerprint: str, aux_layers: tuple[int, ...]) -> HeadSpec:
    """The spec of the recipe's head (``head.kind``) on a target of ``cfg``, reading its layers ``aux_layers``."""
    h, vocab = recipe.head, cfg.vocab_size
    return head_spec(h.kind, h.num_layers, cfg, fingerprint, h.convention, aux_layers,
                     draft_vocab_size(h.draft_vocab, vocab), h.block_size, h.mask_id(vocab), h.fc_norm, h.norm_output,
                     h.parallel_drafts or 0, h.window or 0)


def check_recipe(recipe: Recipe, cfg: ModelConfig) -> None:
    """The train stage's refusals that the recipe and the target's config (``cfg``) decide alone, which
    ``mtp_train.pipeline.check_recipe`` makes before any stage runs (for each head kind the stage trains, as
    ``head.kind``): the head ``TrainInputs.read`` specifies, with the aux layers precompute stores for it, built on the
    meta device (no memory), where its constructor refuses what it cannot be; online, the target's attention backend
    for the engine that scores the features."""
    from mtp_train.heads import build_head
    from mtp_train.heads.eagle3 import aux_layers_for
    from mtp_train.runtime.attention import check_latent

    h = recipe.head
    aux = tuple(aux_layers_for(h.aux_layers, cfg)) if h.kind in AUX_KINDS else ()
    with torch.device("meta"):
        build_head(recipe_head_spec(recipe, cfg, "", aux))
    if recipe.precompute.mode == "online":
        check_latent(recipe.target.attention_backend, cfg.mla is not None)
