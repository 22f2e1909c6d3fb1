"""``mtp-train export RECIPE --format FORMAT [--out DIR]``: a trained head in a serving engine's format.

Formats (``../shared/EXPORT.md``):

- ``vllm``, an ``eagle`` head: ``EagleLlamaForCausalLM``; ``config.json`` is the target's with
  ``num_hidden_layers`` = the head's layers; ``model.safetensors`` holds ``fc.weight [H, 2H]`` (no bias) and
  ``layers.{i}.*`` in HF names, without layer 0's ``input_layernorm`` and without ``model.`` (vLLM adds it), and
  neither the embedding nor an lm_head (the engine shares the target's).
- ``sglang``, an ``eagle`` head: the same with ``LlamaForCausalLMEagle`` and an explicit zero ``fc.bias``, since
  SGLang builds ``fc`` with a bias and would otherwise leave it at its initial value.
- ``vllm`` and ``sglang``, an ``mtp`` head on a DeepSeek-V3-family target: the DeepSeek-V3 layout
  (``heads/deepseek_layout.py``): ``model.layers.{L}.enorm / hnorm / eh_proj / shared_head.norm`` and the decoder
  layer (MLA, and experts as the target's layer L would have them), with copies of the target's embedding and
  lm_head (``embed_tokens``, ``shared_head.head``, which vLLM loads and SGLang skips); ``config.json`` is the
  target's with ``num_nextn_predict_layers`` 1, which both engines turn into their MTP model. Both engines rewrite
  only DeepSeek-V3-family configs into an MTP model, so an ``mtp`` head on any other family (DeepSeek-V2, Llama,
  Mistral, Qwen2, Qwen3) is refused with a line that says what serves it (this runtime), rather than writing files
  that would load wrongly.

- ``vllm``, a ``dflash`` head: vLLM's ``DFlashDraftModel`` (``heads/dflash_layout.py``), with the trained mask vector
  in ``mask_embedding.pt``; of one layer only (vLLM 0.32 normalises every layer's context keys with one ``k_norm``
  row, so a head of more layers is refused).

A head with ``head.window`` carries it where the engine reads a draft's sliding window: vLLM's eagle3 layer
(``layer_types: ["sliding_attention"]`` and ``sliding_window``; in the speculators format, in its layer config), vLLM's
DFlash layers (``dflash_config.use_swa`` and ``swa_window_size``: sliding and non-causal, as trained), and for SGLang
the model card's ``--speculative-draft-window-size``. vLLM and SGLang window no mtp or EAGLE-1 draft, so those are
refused with a window.

The export refuses, naming the difference, a head whose conventions (:mod:`mtp_train.heads.conventions`), target
fingerprint or vocabulary differ from what the format's engine will run it with. It writes into a temporary
directory and renames it into place, so a refused or failed export leaves nothing behind. The directory also holds
``README.md``, a short model card: target, data, steps, the report's τ and engine MAL per k, and where the report is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtp_train.eval.model_card import card_markdown
from mtp_train.eval.report import FILES, load_report
from mtp_train.errors import UserError
from mtp_train.heads.conventions import ENGINE_NAMES, LOADER_FAMILIES, NO_DRAFT_HOOKS, choices, served_by
from mtp_train.heads.deepseek_layout import SHARED_COPIES, to_deepseek
from mtp_train.heads.eagle3 import default_aux_layers
from mtp_train.heads.dflash_layout import MASK_FILE, dflash_config, to_dflash
from mtp_train.heads.eagle3_layout import eagle3_config, to_eagle3
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.io import fresh_dir, replace_dir, write_atomic, write_json_atomic
from mtp_train.lock import exclusive
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.train.checkpoint import head_to_hf, load_trained_head

FORMATS = ("vllm", "sglang", "speculators")
ARCHITECTURES = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
# Keys of the target's config that describe its checkpoint, not the head's.
DROPPED_KEYS = ("quantization_config", "auto_map", "_name_or_path", "transformers_version")


def export_head(recipe: Recipe, fmt: str, out: Path | None = None, name: str | None = None) -> Path:
    """Write the recipe's trained head (or the head ``name``: ``imported/NAME``, as ``eval.compare`` names it) for
    ``fmt`` into ``out``; returns ``out``. Every refusal is a UserError."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    target_config = json.loads((recipe.target.path / "config.json").read_text(encoding="utf-8"))
    target = ModelConfig.from_hf(target_config, str(recipe.target.path / "config.json"))
    root = recipe.draft_dir(name) if name else recipe.head_dir()
    if not (root / "config.json").is_file():
        if name:
            raise UserError(f"{root}: no head imported there; `mtp-train import RECIPE SRC_DIR --name NAME` writes "
                            "imported/NAME")
        raise UserError(f"{root}: no trained {recipe.head.kind} head; run `mtp-train train` first")
    head = load_trained_head(root, recipe.target.path, target)  # another target, hidden size or vocabulary: refused
    spec = head.spec
    check_format(spec.kind, target.family, fmt, root, spec.num_layers, spec.parallel_drafts, spec.window)
    _check_servable(spec.kind, spec.choices, target.family, "vllm" if fmt == "speculators" else fmt, root)
    if fmt == "sglang" and spec.norm_before_residual:
        raise UserError(f"--format sglang: {root} is an eagle3 head with norm_before_residual, which SGLang 0.5.23 "
                        "does not read (vLLM does); export it with --format vllm or speculators")

    out = out or recipe.export_dir(fmt, name)
    with exclusive(out.with_name(f".lock.{out.name}"), "export"):  # a second export there refuses in one line
        tmp = fresh_dir(out.with_name(f".{out.name}.tmp"))
        tensors = head_to_hf(head)
        if spec.kind == "eagle3":
            tensors = to_eagle3(tensors, target.vocab_size, "layers.0." if fmt == "speculators" else "midlayer.")
        elif spec.kind == "mtp":
            tensors = to_deepseek(tensors, target.num_layers)
            frozen = FrozenTarget.load(recipe.target.path)
            for name, weight in zip(SHARED_COPIES, (frozen.embed_weight, frozen.lm_head_weight)):
                tensors[f"model.layers.{target.num_layers}.{name}"] = weight.clone()
        elif spec.kind == "dflash":
            tensors, mask = to_dflash(tensors)
            torch.save({"embedding": mask.clone(), "mask_token_id": spec.mask_token_id}, tmp / MASK_FILE)
        elif fmt == "sglang":
            tensors["fc.bias"] = tensors["fc.weight"].new_zeros(tensors["fc.weight"].shape[0])
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        trained = json.loads((root / "config.json").read_text(encoding="utf-8"))
        write_json_atomic(tmp / "config.json", _config(target_config, spec, fmt, trained, str(recipe.target.path)))
        write_atomic(tmp / "README.md", model_card(recipe, spec, fmt, trained))
        replace_dir(tmp, out)
    return out


def check_format(kind: str, family: str, fmt: str, root: Path, num_layers: int, parallel_drafts: int = 0,
                 window: int = 0) -> None:
    """Refuse ``fmt`` for the ``kind`` head of ``num_layers`` layers at ``root`` on a ``family`` target where no engine
    of the format loads it: the recipe (``head.kind``, ``head.num_layers``), the target's config and ``--format``
    decide it alone, so
    ``mtp_train.pipeline.check_recipe`` refuses it before the export runs. (The conventions the head was trained in
    are its own config.json's: ``_check_servable``.)"""
    if kind == "dflash" and fmt != "vllm":
        raise UserError(f"--format {fmt}: {root} is a dflash head; it exports for vLLM's DFlash loader "
                        "(--format vllm)")
    if parallel_drafts and fmt == "sglang":
        raise UserError(f"--format sglang: {root} is a P-EAGLE head (head.parallel_drafts {parallel_drafts}); SGLang "
                        "0.5.23 drafts eagle3 heads in a chain only, so export it with --format vllm or speculators")
    if fmt == "speculators" and kind != "eagle3":
        raise UserError(f"--format speculators: {root} is an {kind} head; the speculators format holds eagle3 "
                        "heads here (train head.kind=eagle3), or export this one with --format vllm or sglang")
    engine = ENGINE_NAMES["vllm" if fmt == "speculators" else fmt]
    if window and kind in ("mtp", "eagle"):
        raise UserError(f"--format {fmt}: {root} is an {kind} head with head.window {window}, and {engine} runs no "
                        f"sliding window in its {kind} drafts (vLLM 0.32 and SGLang 0.5.23 window eagle3 and dflash "
                        "drafts only); train it with head.window: null to export it, or serve it with this runtime")
    if family in NO_DRAFT_HOOKS and kind != "mtp":
        why = (NO_DRAFT_HOOKS[family] if fmt != "sglang" else "SGLang 0.5.23 captures EAGLE-3 layers on it, but its "
               "draft embeds tokens without the target's embedding scale, and no SGLang runs here to check an export")
        raise UserError(f"{root}: a {kind} head on a {family} target is not exported for {engine}: {why}; serve it "
                        "with this runtime (`mtp-train eval`)")
    if family not in LOADER_FAMILIES[kind]:
        if kind == "mtp":
            raise UserError(f"{root}: an mtp head on a {family} target cannot be exported for {engine}: no serving "
                            "engine loads an MTP layer for this family (vLLM and SGLang serve DeepSeek-layout MTP "
                            "layers only for DeepSeek-V3-family targets); serve it with this runtime (`mtp-train "
                            "eval`)" + ("" if family.startswith("deepseek") else
                                        ", or train head.kind=eagle to export for vLLM or SGLang"))
        raise UserError(f"{root}: {engine}'s EAGLE-1 loader builds a Llama decoder layer; a {family} target's head "
                        "(its decoder layer) would not load there as trained; serve it with this runtime "
                        "(`mtp-train eval`)")
    if kind == "dflash" and num_layers > 1:
        raise UserError(f"{root}: a dflash head of {num_layers} layers cannot be exported for vLLM: vLLM 0.32's "
                        "DFlash loader normalises every layer's context keys with one k_norm weight row, so the "
                        "layers past the first would run with other keys than they were trained with; train "
                        "head.num_layers=1 to export it, or serve this one with this runtime (`mtp-train eval`)")
    if kind == "mtp" and num_layers > 1:
        raise UserError(f"{root}: an mtp head of {num_layers} layers cannot be exported in the DeepSeek-V3 layout, "
                        "which holds one decoder layer per MTP layer; train head.num_layers=1 to export it, or serve "
                        "this one with this runtime (`mtp-train eval`)")


def _check_servable(kind: str, head, family: str, fmt: str, root: Path) -> None:
    """Refuse a head (of ``check_format``'s kinds and families) trained in other conventions than ``fmt``'s engine
    runs it with."""
    engine = ENGINE_NAMES[fmt]
    if fmt in served_by(kind, head, family):
        return
    want = choices(kind, fmt)
    raise UserError(f"{root}/config.json: the head was trained in other conventions than {engine} runs it with: it "
                    f"{head.describe()}, {engine} {want.describe()}; train it again with head.convention={fmt}")


def _config(target_config: dict, spec, fmt: str, trained: dict, target_path: str) -> dict:
    """The target's config made the head's (``num_hidden_layers``, ``architectures``, the weights' dtype), plus a
    record of how it was trained (``mtp_train``, ignored by the engines)."""
    config = {k: v for k, v in target_config.items() if k not in DROPPED_KEYS}
    if spec.kind == "eagle3":
        config = eagle3_config(config, target_path, list(spec.aux_layers), _default_aux(spec.target),
                               spec.draft_vocab, fmt, spec.fc_norm, spec.norm_output, spec.parallel_drafts,
                               spec.mask_token_id, spec.norm_before_fc, spec.norm_before_residual)
    elif spec.kind == "dflash":
        config = dflash_config(spec)
    elif spec.kind == "mtp":  # the target's config, its layers kept: the MTP layer is found at index num_hidden_layers
        config.update(num_nextn_predict_layers=1, torch_dtype="float32")
    else:
        config.update(architectures=[ARCHITECTURES[fmt]], num_hidden_layers=spec.num_layers, torch_dtype="float32")
    if spec.kind not in ("eagle3", "dflash"):
        config.pop("dtype", None)
    if fmt == "sglang" and spec.kind == "eagle":
        config["bias"] = True  # SGLang's fc bias flag; the exported bias is zero
    window(config, spec, fmt)
    config["mtp_train"] = {"head_kind": spec.kind, "convention": spec.convention, "hidden_input": spec.hidden_input,
                           "feedback": spec.feedback, "zero_embed_at_position0": spec.zero_embed_at_position0,
                           "target_fingerprint": spec.target_fingerprint, "steps": trained.get("steps"),
                           "training_fingerprint": trained.get("training_fingerprint")}
    return config


def window(config: dict, spec, fmt: str) -> None:
    """Write ``head.window`` where the format's engine reads a draft's sliding window: vLLM's eagle3 layer from
    ``layer_types`` and ``sliding_window`` (the speculators format: in its layer config), its DFlash layers from
    ``dflash_config.use_swa`` and ``swa_window_size`` (non-causal, as trained). SGLang takes the window from its
    server flag ``--speculative-draft-window-size`` (the model card says so); the config records it."""
    if not spec.window:
        return
    if spec.kind == "dflash":
        config["dflash_config"].update(use_swa=True, swa_window_size=spec.window)
        return
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    layer.update(layer_types=["sliding_attention"], sliding_window=spec.window)


def _default_aux(cfg: ModelConfig) -> list[int]:
    """The engines' default aux layers for this target, or none where a shallow target has no valid default."""
    try:
        return default_aux_layers(cfg)
    except UserError:
        return []


def _provenance(recipe: Recipe, trained: dict) -> list[str]:
    """The card's lines on where the head was trained: the recipe's data, or what ``mtp-train import`` read."""
    imported = trained.get("imported")
    if imported:
        return [f"- Trained elsewhere: imported from `{imported['source']}` ({imported['layout']} layout) by "
                "`mtp-train import`."]
    return [f"- Data: {', '.join(f'`{p.name}`' for p in recipe.data.train)}"
            + (", answers regenerated by the target" if recipe.data.regenerate else "")
            + f"; {trained.get('steps', '?')} training steps.",
            f"- Validation (trainer): {json.dumps(trained.get('validation', {}))}."]


def model_card(recipe: Recipe, spec, fmt: str, trained: dict) -> str:
    """A short README for the exported directory."""
    report_path = recipe.eval_dir / FILES["json"]
    lines = [f"# {spec.kind} draft head for {recipe.target.path.name} ({ENGINE_NAMES[fmt]} format)", "",
             f"- Target: `{recipe.target.path}` (fingerprint `{spec.target_fingerprint[:16]}`), "
             f"{spec.target.num_layers} layers, hidden {spec.target.hidden_size}, vocab {spec.target.vocab_size}.",
             f"- Head: {spec.kind}, {spec.num_layers} decoder layer(s), convention `{spec.convention}`: it "
             f"{spec.describe()}.",
             *_provenance(recipe, trained)]
    try:
        report = load_report(report_path)
    except UserError:
        report = None
    if report is None or report.mode != spec.kind or trained.get("imported"):
        lines += ["", f"No eval report of this head was found at `{report_path}`; run `mtp-train eval` for one."]
    else:  # the report's own model-card block, measured in this toolkit's runtime
        lines += ["", f"Measured in this toolkit's runtime (`{report_path}`). Engine MAL is 1 + accepted / drafts, "
                      "comparable with what vLLM and SGLang print.", "", card_markdown(report).rstrip("\n")]
    k = spec.block_size - 1 if spec.kind == "dflash" else 3
    vllm = ["```python", f'LLM(model="{recipe.target.path}", speculative_config={{"method": "{spec.kind}", '
                         f'"model": "THIS_DIR", "num_speculative_tokens": {k}}})', "```"]
    serve = {"vllm": vllm, "speculators": vllm,
             "sglang": ["```", f"python -m sglang.launch_server --model-path {recipe.target.path} "
                               f"--speculative-algorithm {'EAGLE3' if spec.kind == 'eagle3' else 'EAGLE'} "
                               "--speculative-draft-model-path THIS_DIR "
                               "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
                               + (f" --speculative-draft-window-size {spec.window}" if spec.window else ""),
                        "```"]}
    lines += ["", f"Serve it ({ENGINE_NAMES[fmt]}):", "", *serve[fmt], ""]
    return "\n".join(lines)
