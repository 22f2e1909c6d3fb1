"""Rules across a recipe's sections that a stage would otherwise refuse only when it runs; ``Recipe`` checks them
when it is read (a ``ValueError`` there becomes the recipe's one-line error), so ``--dry-run`` refuses them too."""

from __future__ import annotations

from typing import Any


def check_rules(recipe: Any) -> None:
    """Refuse a ``mtp_train.recipe.Recipe`` (passed in: this module sits below it) that breaks a rule."""
    dflash_drafts_within_its_block(recipe)
    trained_heads_take_the_train_settings(recipe)
    eagle3_norms_need_an_eagle3_head(recipe)
    parallel_drafts_within_what_trains(recipe)
    window_beyond_the_drafts(recipe)
    tau_probes_need_heldout_rows(recipe)


def dflash_drafts_within_its_block(recipe: Any) -> None:
    """A dflash head trains block positions 1..block_size-1 only: the eval (its head, or a dflash comparison) may not
    draft past them, in a chain (``eval.k``) or a tree (``eval.trees``' depth)."""
    head = recipe.eval.draft == "head" and recipe.eval.draft_model is None and recipe.head.kind == "dflash"
    if not head and "dflash" not in recipe.eval.compare:
        return
    size = recipe.head.block_size
    _drafts_within(recipe, size - 1, f"past what a dflash head of head.block_size {size} trains (draft positions "
                   f"1..{size - 1})", "head.block_size", 1)


def _drafts_within(recipe: Any, most: int, trained: str, setting: str, extra: int) -> None:
    """Refuse an ``eval.k`` or an ``eval.trees`` depth of more than ``most`` drafts, which go ``trained`` (past what
    the head trains); the fix names ``setting``, raised to the drafts plus ``extra``."""
    deepest = max((t.depth for t in recipe.eval.trees), default=0)
    for named, drafts, lower in (("eval.k: k =", max(recipe.eval.k), "eval.k"), ("eval.trees: depth", deepest,
                                                                                  "the depth")):
        if drafts > most:
            raise ValueError(f"{named} {drafts} drafts {trained}; lower {lower} to at most {most}, or set {setting} "
                             f"to at least {drafts + extra} and train again")


def trained_heads_take_the_train_settings(recipe: Any) -> None:
    """``train`` and ``head`` settings that a head the train stage trains (``Recipe.head_kinds``) cannot take."""
    kinds = recipe.head_kinds()

    def named(kind: str) -> str:
        return (f"head.kind {kind}" if recipe.eval.draft == "head" and kind == recipe.head.kind
                else f"eval.compare trains {kind}")

    if "dflash" in kinds and recipe.train.mask_gate == "input":
        raise ValueError("train.mask_gate: `input` gates a chain head's steps; a dflash block's predictions are "
                         f"gated by their own labels ({named('dflash')}): set train.mask_gate: label")
    dpace = "dpace_alpha" in recipe.train.model_fields_set and recipe.train.dpace_alpha is not None
    if dpace and "dflash" not in kinds:
        raise ValueError("train.dpace_alpha: D-PACE weights a dflash head's block positions, and this recipe trains "
                         f"{', '.join(kinds) or 'no head'}; set head.kind: dflash or train.dpace_alpha: null")
    if "eagle3" in kinds and recipe.head.num_layers != 1:
        raise ValueError(f"head.num_layers: an eagle3 head has one decoder layer ({named('eagle3')}), not "
                         f"{recipe.head.num_layers}: set head.num_layers: 1")


def eagle3_norms_need_an_eagle3_head(recipe: Any) -> None:
    """``head.fc_norm``, ``head.norm_output`` (EAGLE 3.1's), ``head.norm_before_fc`` and ``head.norm_before_residual``
    (speculators') change an eagle3 head only, so a recipe that trains none (``head.kind``, ``eval.compare``) would
    set them for nothing."""
    if recipe.head.fc_norm and recipe.head.norm_before_fc:
        raise ValueError("head.norm_before_fc: one norm over the concatenation, where head.fc_norm gives each aux "
                         "layer its own; speculators refuses the two together: set one of them false")
    if "eagle3" in recipe.head_kinds():
        return
    for name in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        if getattr(recipe.head, name):
            raise ValueError(f"head.{name}: applies to eagle3 heads only, and this recipe trains "
                             f"{', '.join(recipe.head_kinds()) or 'no head'}; set head.kind: eagle3 or head.{name}: "
                             "false")


def parallel_drafts_within_what_trains(recipe: Any) -> None:
    """``head.parallel_drafts`` (P-EAGLE) is an eagle3 head's; it trains one step and its mask positions, so the
    eval's head may not draft past them, and a chain step (``train.unroll`` above 1) would train what is never
    served."""
    drafts = recipe.head.parallel_drafts
    if drafts is None:
        return
    if recipe.head.kind != "eagle3":
        raise ValueError(f"head.parallel_drafts: P-EAGLE is an eagle3 head's option, and head.kind is "
                         f"{recipe.head.kind}; set head.kind: eagle3 or head.parallel_drafts: null")
    if recipe.train.unroll != 1:
        raise ValueError(f"train.unroll: {recipe.train.unroll} chains steps that a P-EAGLE head "
                         f"(head.parallel_drafts {drafts}) never runs; set train.unroll: 1")
    if recipe.eval.draft != "head" or recipe.eval.draft_model is not None:
        return
    _drafts_within(recipe, drafts, f"past the {drafts} a P-EAGLE head drafts in one forward (head.parallel_drafts)",
                   "head.parallel_drafts", 0)


def window_beyond_the_drafts(recipe: Any) -> None:
    """``head.window`` must hold every draft of a step beside some context (``eval.k``, tree depths, the unrolled
    training steps, a dflash block); P-EAGLE's mask positions take none (not built)."""
    window = recipe.head.window
    if window is None:
        return
    if recipe.head.parallel_drafts:
        raise ValueError("head.window: a P-EAGLE head (head.parallel_drafts) takes no window yet; set one of the two "
                         "to null")
    sizes = {"train.unroll": recipe.train.unroll, "eval.k": max(recipe.eval.k),
             "the eval.trees depth": max((t.depth for t in recipe.eval.trees), default=0)}
    if "dflash" in recipe.head_kinds():
        sizes["head.block_size"] = recipe.head.block_size
    name, most = max(sizes.items(), key=lambda kv: kv[1])
    if window <= most:
        raise ValueError(f"head.window: {window} tokens do not exceed {name} ({most}); set head.window above {most} "
                         "or null")


def tau_probes_need_heldout_rows(recipe: Any) -> None:
    """``train.tau_every`` decodes held-out prompts: a recipe that holds no rows out has none."""
    if recipe.train.tau_every and recipe.data.heldout_rows == 0:
        raise ValueError("train.tau_every: the τ probe decodes held-out prompts and data.heldout_rows is 0; set "
                         "data.heldout_rows above 0 (and precompute again) or train.tau_every: 0")
