"""What the eval loads before its first decoding step: the target's engine with its drafts (their K/V sharing its
budget), the comparison drafts, the prompts, and the report to compare against."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mtp_train.eval.prompts import EvalPrompt, load_prompt_set, render_prompt
from mtp_train.errors import UserError
from mtp_train.eval.report import load_report
from mtp_train.features.manifest import target_fingerprint
from mtp_train.heads import DraftHead
from mtp_train.models.config import ModelConfig
from mtp_train.models.transformer import Transformer
from mtp_train.recipe import Recipe
from mtp_train.recipe_eval import EvalConfig
from mtp_train.runtime.drafters import Drafter, HeadDrafter, head_drafter
from mtp_train.runtime.engine import Engine, default_stop_ids, kv_budget, reserved_for
from mtp_train.runtime.kv_cache import KVPool
from mtp_train.train.checkpoint import load_trained_head

def baseline_path(recipe: Recipe, given: Path | None) -> Path | None:
    """The report to compare against (``--baseline``, else ``eval.baseline``), read once up front: a file that is
    not a report stops the stage before it decodes or writes anything, with a line that names where it came from."""
    path, source = (given, "--baseline") if given is not None else (recipe.eval.baseline, "eval.baseline")
    if path is not None:
        try:
            load_report(path)
        except UserError as e:
            raise UserError(f"{source} {e}; give the report.json of an earlier eval") from None
    return path


def load_eval(recipe: Recipe) -> tuple[Engine, Drafter, Any, dict[str, Any]]:
    """The engine, the draft, its validation (a head's: run at the end) and what the comparison drafts need.

    Every draft is loaded, onto the device, before the engine sizes its KV cache: the budget (``kv_budget``) is
    measured with their weights in place, and the drafts' K/V pools, which hold as many token slots as the target's,
    share it with the target's in proportion to their bytes per slot."""
    from mtp_train.models.checkpoint import load_transformer
    from mtp_train.runtime.device import default_device, resolve_dtype
    from mtp_train.runtime.drafters import DraftModelDrafter
    from mtp_train.models.tp import init_tensor_parallel

    device = default_device()
    dtype = resolve_dtype(recipe.target.dtype, device)
    tp = init_tensor_parallel(recipe.target.tp, device)  # under torchrun --nproc_per_node TP
    model = load_transformer(recipe.target.path, dtype=dtype, device=device, tp=tp)
    if recipe.eval.draft_model is not None:
        draft: Any = load_transformer(recipe.eval.draft_model, dtype=dtype, device=device)
    elif recipe.eval.draft == "target_mtp":
        draft = target_mtp(recipe, model.cfg)
    else:
        draft = load_trained_head(recipe.head_dir(), recipe.target.path, model.cfg)
    others = {name: load_other(recipe, model.cfg, name) for name in recipe.eval.compare}
    if tp.rank == 0:  # the leader alone holds the drafts (see HeadDrafter)
        for head in [draft, *others.values()]:
            if isinstance(head, DraftHead):
                head.to(device, dtype)
    drafts = [draft, *others.values()]
    with_attention = sum(isinstance(d, (DraftHead, Transformer)) for d in drafts)  # a bigram table has none
    reserved = reserved_for(recipe.target, model.cfg, dtype, device, tp.size, with_attention)
    kv = kv_share(kv_budget(recipe.target, device, reserved), model.cfg, dtype, tp.size, drafts)
    engine = Engine(model, stop_ids=default_stop_ids(recipe.target.path), backend=recipe.target.attention_backend,
                    kv_bytes=kv, max_seqs=recipe.eval.batch_size)
    vocab = draft_vocab(recipe, engine.cfg.vocab_size)
    if recipe.eval.draft_model is not None:
        return engine, DraftModelDrafter(engine, draft), None, others
    if recipe.eval.draft == "target_mtp":
        return engine, HeadDrafter(engine, draft, "target_mtp", vocab), None, others
    from mtp_train.train.objective import loss_weights
    from mtp_train.features.online import open_features

    root = recipe.head_dir()
    drafter = head_drafter(engine, draft, vocab)
    trainer_numbers = json.loads((root / "config.json").read_text()).get("validation", {})
    reader = open_features(recipe)  # its shards checked now, read at the end

    def head_validation() -> dict[str, Any]:
        from mtp_train.eval.validation import runtime_validation

        ours = runtime_validation(engine, drafter, reader, loss_weights(recipe))
        return {"runtime": ours, "trainer": trainer_numbers}

    return engine, drafter, head_validation, others


def kv_share(budget: int, cfg: ModelConfig, dtype: torch.dtype, tp_size: int, drafts: list[Any]) -> int:
    """The target's part of a KV ``budget`` that it shares with the drafts' pools (one token slot each for every
    slot of the target's): its bytes per slot over everyone's. A draft model and a head have pools of their own
    layers (whole on the leader); a bigram table (a tensor) has none."""
    target = KVPool.bytes_per_token(cfg, dtype, tp_size)
    drafts_per_slot = 0
    for draft in drafts:
        if isinstance(draft, DraftHead):
            drafts_per_slot += KVPool.bytes_per_token(replace(draft.spec.target, num_layers=len(draft.layers)),
                                                      dtype, 1)
        elif isinstance(draft, Transformer):
            drafts_per_slot += KVPool.bytes_per_token(draft.cfg, dtype, 1)
    return budget * target // (target + drafts_per_slot)


def eval_prompts(recipe: Recipe, engine: Engine) -> tuple[list[EvalPrompt], list[list[int]], int, Any]:
    """The prompts that fit the target's positions, their token ids, how many did not fit, the tokenizer."""
    from mtp_train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(recipe)
    e = recipe.eval
    kept, ids, skipped = fitting_prompts(recipe, e.prompt_sets, e.max_prompts, prompt_room(engine.cfg, e), tokenizer)
    if not kept:
        raise no_prompt_fits(engine.cfg, e)
    return kept, ids, skipped, tokenizer


def fitting_prompts(recipe: Recipe, names: list[str], max_prompts: int | None, room: int, tokenizer: Any
                    ) -> tuple[list[EvalPrompt], list[list[int]], int]:
    """The prompts of the sets ``names`` (at most ``max_prompts`` of each; ``heldout``: the recipe's held-out rows)
    whose rendered ids hold at most ``room`` tokens, their ids, and how many did not fit (the eval's prompts; the
    τ probe's)."""
    prompts: list[EvalPrompt] = []
    for name in names:
        kwargs: dict[str, Any] = heldout_rows(recipe) if name == "heldout" else {}
        prompts += load_prompt_set(name, max_prompts=max_prompts, seed=recipe.seed, **kwargs)
    kept, ids = [], []
    for p in prompts:
        tokens = render_prompt(tokenizer, p.messages)
        if len(tokens) <= room:  # else it would not fit the target's positions with the answer
            kept.append(p)
            ids.append(tokens)
    return kept, ids, len(prompts) - len(kept)


def prompt_room(cfg: ModelConfig, e: EvalConfig) -> int:
    """The most prompt tokens that fit the target's positions with an answer of ``eval.max_new_tokens`` and the longest
    chain's drafts (``e``: the recipe's eval section)."""
    return room_for(cfg, e.max_new_tokens, max(e.k))


def room_for(cfg: ModelConfig, new_tokens: int, k: int) -> int:
    """The most prompt tokens that fit the target's positions with ``new_tokens`` and ``k`` drafts after them."""
    return cfg.max_positions - new_tokens - k - 2


def no_prompt_fits(cfg: ModelConfig, e: EvalConfig) -> UserError:
    return UserError(f"eval.prompt_sets: no prompt fits the target's {cfg.max_positions} positions with "
                     f"eval.max_new_tokens={e.max_new_tokens}")


NO_HELDOUT = "eval.prompt_sets: `heldout` needs data.heldout_rows > 0 at precompute time"


def check_recipe(recipe: Recipe, cfg: ModelConfig) -> None:
    """The eval's refusals that the recipe and the configs of the checkpoints it names (the target's, ``cfg``, and a
    draft model's) decide alone, which ``mtp_train.pipeline.check_recipe`` makes before any stage runs: the target's
    attention backend, a draft model's vocabulary, the target's own MTP layers when they draft, the held-out prompts
    of a recipe that holds none out, and prompts with no room left."""
    from mtp_train.hf_checkpoint import find_checkpoint
    from mtp_train.runtime.attention import check_latent
    from mtp_train.runtime.drafters import check_draft_vocab
    from mtp_train.train.checkpoint import target_mtp_layers

    e = recipe.eval
    check_latent(recipe.target.attention_backend, cfg.torch_only)
    if e.draft_model is not None:
        draft = find_checkpoint(e.draft_model, "eval.draft_model")
        check_draft_vocab(ModelConfig.from_hf(draft.config, str(draft.root / "config.json")).vocab_size,
                          cfg.vocab_size)
    if (e.draft == "target_mtp" and e.draft_model is None) or "target_mtp" in e.compare:
        target_mtp_layers(recipe.target.path, cfg)
    if "heldout" in e.prompt_sets and recipe.data.heldout_rows == 0:
        raise UserError(NO_HELDOUT)
    if prompt_room(cfg, e) < 1:
        raise no_prompt_fits(cfg, e)


def heldout_rows(recipe: Recipe) -> dict[str, Any]:
    """The rows training never saw: the manifest's held-out ids, read from the recipe's data."""
    from mtp_train.data.dataset import load_rows
    from mtp_train.features.manifest import load_manifest

    manifest_file = recipe.features_dir / "manifest.json"
    if not manifest_file.is_file():
        raise UserError(f"{manifest_file} not found; the `heldout` prompt set needs `mtp-train precompute` first")
    ids = load_manifest(manifest_file).heldout_row_ids
    if not ids:
        raise UserError(NO_HELDOUT)
    wanted = set(ids)
    d = recipe.data
    rows = [r for r in load_rows(d.train, d.format, d.skip_bad_rows, d.max_rows).rows if r.row_id in wanted]
    return {"heldout_rows": rows, "heldout_ids": ids}


def load_other(recipe: Recipe, cfg: ModelConfig, name: str):
    """What a comparison draft needs: another trained head kind, or for the bigram baseline its successor table
    from the training features."""
    from mtp_train.runtime.bigram_drafter import BigramDrafter
    from mtp_train.features.online import open_features

    if name == "bigram":
        reader = open_features(recipe)
        tokens = [reader.load(ref)["input_ids"] for ref in reader.train]
        return BigramDrafter.from_tokens(tokens, cfg.vocab_size)
    if name == "target_mtp":
        return target_mtp(recipe, cfg)
    root = recipe.draft_dir(name)
    if not (root / "model.safetensors").is_file():
        raise UserError(f"eval.compare: no {name!r} head in {root}; run `mtp-train train` with it (an imported one: "
                        "`mtp-train import`) first")
    return load_trained_head(root, recipe.target.path, cfg)


def other_drafter(engine: Engine, name: str, loaded, vocab: torch.Tensor | None) -> Drafter:
    """A comparison draft from what ``_load_other`` loaded; heads draft from ``vocab`` (``eval.draft_vocab``)."""
    from mtp_train.runtime.bigram_drafter import BigramDrafter

    return BigramDrafter(engine, loaded) if name == "bigram" else head_drafter(engine, loaded, vocab, name)


def draft_vocab(recipe: Recipe, vocab_size: int) -> torch.Tensor | None:
    """``[N]`` ascending target ids of the ``eval.draft_vocab`` most frequent assistant tokens (``loss_mask`` 1) of
    the training features, ties to the smaller id; None for the full vocabulary."""
    from mtp_train.train.vocab import frequent_tokens
    from mtp_train.features.online import open_features

    n = recipe.eval.draft_vocab
    if n is None or n >= vocab_size:
        return None
    return frequent_tokens(open_features(recipe), n, vocab_size)


def target_mtp(recipe: Recipe, cfg: ModelConfig):
    """The target checkpoint's own (first) MTP layer as a head."""
    from mtp_train.train.checkpoint import load_target_mtp

    return load_target_mtp(recipe.target.path, cfg, target_fingerprint(recipe.target.path))
