"""The train stage's refusals that the recipe and the target's config decide alone (``mtp_train.pipeline.check_recipe``
makes them before any stage runs), and the head spec a recipe asks for."""

from __future__ import annotations

import torch

from mtp_train.errors import UserError
from mtp_train.heads import AUX_KINDS, HeadSpec, head_spec
from mtp_train.heads.base import load_head_config
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.train.vocab import draft_vocab_size


def recipe_head_spec(recipe: Recipe, cfg: ModelConfig, fingerprint: str, aux_layers: tuple[int, ...]) -> HeadSpec:
    """The spec of the recipe's head (``head.kind``) on a target of ``cfg``, reading its layers ``aux_layers``."""
    h, vocab = recipe.head, cfg.vocab_size
    return head_spec(h.kind, h.num_layers, cfg, fingerprint, h.convention, aux_layers,
                     draft_vocab_size(h.draft_vocab, vocab), h.block_size, h.mask_id(vocab), h.fc_norm, h.norm_output,
                     h.parallel_drafts or 0, h.window or 0, h.norm_before_fc, h.norm_before_residual)


def init_head_spec(recipe: Recipe, cfg: ModelConfig, features_target: str | None = None) -> HeadSpec:
    """``head.init_from``'s spec, checked against the recipe: the head's kind is ``head.kind``, each ``head`` field the
    recipe sets is the head's (the rest are taken from it), an aux kind reads the layers the recipe's features hold,
    and the head is for the features' target (fingerprint ``features_target``, when given); refused, in one line
    naming the field, otherwise."""
    h, path = recipe.head, recipe.head.init_from
    spec = load_head_config(path)
    if features_target is not None and spec.target_fingerprint != features_target:
        raise UserError(f"head.init_from: {path} was trained for another target than the features' "
                        f"({recipe.features_dir}); import it for this target with `mtp-train import`")
    if spec.kind != h.kind:
        raise UserError(f"head.init_from: {path} holds an {spec.kind} head; set head.kind: {spec.kind}")
    if (spec.target.hidden_size, spec.target.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise UserError(f"head.init_from: {path} was built for hidden size {spec.target.hidden_size} and vocabulary "
                        f"{spec.target.vocab_size}; the target has {cfg.hidden_size} and {cfg.vocab_size}")
    wanted = recipe_head_spec(recipe, cfg, spec.target_fingerprint, spec.aux_layers)
    for field in ("num_layers", "draft_vocab", "fc_norm", "norm_output", "norm_before_fc", "norm_before_residual",
                  "window", "block_size", "parallel_drafts", "mask_token_id", "convention"):
        if field in h.model_fields_set and getattr(wanted, field) != getattr(spec, field):
            raise UserError(f"head.{field}: {getattr(h, field)!r} is not the head.init_from head's "
                            f"{getattr(spec, field)!r} ({path}); set it so, or leave it out")
    if spec.kind in AUX_KINDS:
        from mtp_train.heads.eagle3 import aux_layers_for

        stored = tuple(aux_layers_for(h.aux_layers, cfg))
        if stored != spec.aux_layers:
            raise UserError(f"head.aux_layers: the features hold {list(stored)} for this recipe, the head.init_from "
                            f"head reads {list(spec.aux_layers)} ({path}); set head.aux_layers: "
                            f"{list(spec.aux_layers)}")
    return spec


def check_recipe(recipe: Recipe, cfg: ModelConfig) -> None:
    """The train stage's refusals that the recipe and the target's config (``cfg``) decide alone, which
    ``mtp_train.pipeline.check_recipe`` makes before any stage runs (for each head kind the stage trains, as
    ``head.kind``): the head ``TrainInputs.read`` specifies, with the aux layers precompute stores for it, built on the
    meta device (no memory), where its constructor refuses what it cannot be (``head.init_from``'s, checked against
    the recipe: ``init_head_spec``); online, the target's attention backend
    for the engine that scores the features."""
    from mtp_train.heads import build_head
    from mtp_train.heads.eagle3 import aux_layers_for
    from mtp_train.runtime.attention import check_latent

    h = recipe.head
    aux = tuple(aux_layers_for(h.aux_layers, cfg)) if h.kind in AUX_KINDS else ()
    spec = init_head_spec(recipe, cfg) if h.init_from is not None else recipe_head_spec(recipe, cfg, "", aux)
    with torch.device("meta"):
        build_head(spec)
    if recipe.precompute.mode == "online":
        check_latent(recipe.target.attention_backend, cfg.torch_only)
