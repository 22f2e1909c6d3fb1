"""``mtp-train import RECIPE SRC``: a draft head another trainer wrote, read into this runtime's head.

Layouts (``../shared/EXPORT.md`` sections 2-4, ``docs/export.md``), found from the source's ``config.json``:

- ``speculators``: ``speculators_model_type`` ``eagle3`` (or ``peagle``, an eagle3 head drafting in parallel); the
  decoder layer under ``layers.0.``, its shapes in ``transformer_layer_config``, aux ids as given (the input of
  block k).
- ``vllm`` / ``sglang``, eagle3 (an ``architectures`` entry with ``Eagle3``; SpecForge and ModelOpt write it too):
  the layer under ``midlayer.`` (or ``layers.0.``), ``hidden_norm`` beside its ``input_layernorm``. Aux ids at the
  top level are vLLM's (block inputs, as given); the nested ``eagle_config`` ids are read as block inputs by vLLM and
  as block outputs by SGLang (which adds 1), so a file that has them only there needs ``--layout vllm|sglang``.
- ``vllm`` / ``sglang`` / ``eagle``, EAGLE-1 (``fc.weight [H, 2H]``): ``EagleLlamaForCausalLM`` (vLLM),
  ``LlamaForCausalLMEagle`` (SGLang, whose ``fc`` has a bias: it must be zero) or the original EAGLE repository's
  ``LlamaForCausalLM`` with ``fc`` and ``layers.{i}.*``, layer 0 without ``input_layernorm``.
- ``vllm``, dflash (``DFlashDraftModel``): Qwen3-named layers, ``fc``, ``hidden_norm``, ``norm``;
  ``dflash_config.target_layer_ids`` (0-based outputs: aux id + 1), ``mask_token_id`` and the mask vector in
  ``mask_embedding.pt``.

Names, shapes, norms, ``d2t``/``t2d``, the aux numbering, the sliding window and EAGLE 3.1's options map onto a
``HeadSpec`` of the recipe's target; the draft layer must have the target's shapes (this runtime builds it from the
target's config), and an embedding the file carries must be the target's. Anything else is refused in one line that
names the key. The head is written as a trained head (``config.json`` with an ``imported`` record, and
``model.safetensors``), atomically.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mtp_train.errors import UserError
from mtp_train.features.manifest import target_fingerprint
from mtp_train.heads.base import DraftHead, head_spec
from mtp_train.heads.dflash_layout import MASK_FILE
from mtp_train.heads.eagle3 import default_aux_layers
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.lock import exclusive
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.train.checkpoint import head_from_hf, head_to_hf, save_head

LAYOUTS = ("speculators", "vllm", "sglang", "eagle")
EAGLE1 = {"EagleLlamaForCausalLM": "vllm", "LlamaForCausalLMEagle": "sglang", "LlamaForCausalLM": "eagle"}
# The draft layer's config keys that must equal the target's: this runtime builds the layer from the target's config.
SHAPES = {"hidden_size": "hidden_size", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
          "head_dim": "head_dim", "intermediate_size": "intermediate_size"}


def read_source(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``src``'s ``config.json`` and tensors (``model.safetensors``, or ``pytorch_model.bin`` read with
    ``weights_only``), every failure one line."""
    config_path = src / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{config_path}: not found; point at a head directory (config.json and its weights)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_path}: not a JSON config ({str(e)[:120]})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: not a JSON object")
    weights = src / "model.safetensors"
    try:
        if weights.is_file():
            return config, load_file(weights)
        bin_path = src / "pytorch_model.bin"
        if bin_path.is_file():
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
            return config, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    except (OSError, SafetensorError, RuntimeError, pickle.UnpicklingError) as e:
        raise UserError(f"{src}: its weights cannot be read ({str(e).splitlines()[0][:160]})") from None
    raise UserError(f"{src}: no model.safetensors or pytorch_model.bin beside config.json")


def detect(config: dict, tensors: dict[str, torch.Tensor], source: str) -> tuple[str, str]:
    """``(kind, layout)`` of a head's config and tensors; refused where it is none this module reads."""
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind in ("eagle3", "peagle"):
            return "eagle3", "speculators"
        raise UserError(f"{source}: speculators_model_type {kind!r}: this toolkit imports speculators' eagle3 and "
                        "peagle heads")
    architectures = config.get("architectures") or []
    if any("Eagle3" in a for a in architectures):
        return "eagle3", "vllm"
    if "DFlashDraftModel" in architectures:
        return "dflash", "vllm"
    fc = tensors.get("fc.weight")
    for name in architectures:
        if name in EAGLE1 and fc is not None and fc.ndim == 2 and fc.shape[1] == 2 * fc.shape[0]:
            return "eagle", EAGLE1[name]
    raise UserError(f"{source}: architectures {architectures}: not a draft head this toolkit reads (EAGLE-1, EAGLE-3, "
                    "speculators eagle3/peagle or vLLM's DFlash)")


def _check_layer(layer: dict, target: ModelConfig, source: str, where: str) -> None:
    """The draft layer's shapes and RoPE base, which must be the target's."""
    for key, attr in SHAPES.items():
        value = layer.get(key)
        if value is not None and int(value) != getattr(target, attr):
            raise UserError(f"{source}: {where}{key} {value} is not the target's {getattr(target, attr)}; this runtime "
                            "builds the draft layer with its target's shapes")
    theta = layer.get("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta"))
    if theta is not None and float(theta) != target.rope.theta:
        raise UserError(f"{source}: {where}rope_theta {theta} is not the target's {target.rope.theta}")


def _window(layer: dict) -> int:
    """A sliding window the layer config declares (``layer_types`` sliding, ``sliding_window``), else 0."""
    sliding = "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window")
    return int(layer.get("sliding_window") or 0) if sliding else 0


def _aux_ids(config: dict, layout: str, asked: str | None, target: ModelConfig, source: str) -> list[int]:
    """The aux layers in this toolkit's numbering (the input of block k)."""
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:  # vLLM's top level and speculators': as given
        return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is None:
        return default_aux_layers(target)
    if asked not in ("vllm", "sglang"):
        raise UserError(f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids {nested}: vLLM reads them as the "
                        "inputs of those blocks, SGLang as their outputs; say which engine the file was written for "
                        "with --layout vllm or --layout sglang")
    return [int(i) + (1 if asked == "sglang" else 0) for i in nested]


def _eagle3(config: dict, tensors: dict[str, torch.Tensor], layout: str, asked: str | None, target: ModelConfig,
            embed: torch.Tensor, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """An eagle3 head's ``head_spec`` arguments and tensors in this toolkit's names (``head_to_hf``'s)."""
    layer = (config.get("transformer_layer_config") or config) if layout == "speculators" else config
    _check_layer(layer, target, source, "transformer_layer_config." if layout == "speculators" else "")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise UserError(f"{source}: eagle_config.use_aux_hidden_state is false; an eagle3 head here reads aux states")
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."
    out: dict[str, torch.Tensor] = {}
    d2t = t2d = None
    for name, tensor in tensors.items():
        if name == prefix + "hidden_norm.weight":
            out["hidden_norm.weight"] = tensor
        elif name.startswith(prefix):
            out["layers.0." + name.removeprefix(prefix)] = tensor
        elif name == "d2t":
            d2t = tensor.long()
        elif name == "t2d":
            t2d = tensor.bool()
        elif name == "embed_tokens.weight":
            _check_embedding(tensor, embed, source)
        elif name in ("fc.weight", "norm.weight", "lm_head.weight", "mask_hidden", "input_norm.weight") or \
                name.startswith("fc_norm."):
            out[name] = tensor
        else:
            raise UserError(f"{source}: tensor {name!r} is not part of an eagle3 head this toolkit runs")
    if "lm_head.weight" not in out:
        raise UserError(f"{source}: no lm_head.weight; an eagle3 head drafts from its own lm_head")
    draft_vocab = out["lm_head.weight"].shape[0]
    ids = torch.arange(draft_vocab) if d2t is None else torch.arange(draft_vocab) + d2t
    if d2t is None and draft_vocab != target.vocab_size:
        raise UserError(f"{source}: lm_head.weight has {draft_vocab} rows, the target's vocabulary "
                        f"{target.vocab_size}, and no d2t maps them")
    if ids.numel() != draft_vocab or (ids.diff() <= 0).any() or ids[0] < 0 or ids[-1] >= target.vocab_size:
        raise UserError(f"{source}: d2t does not map the draft ids to ascending target ids below {target.vocab_size}")
    if t2d is not None and (t2d.numel() != target.vocab_size or not torch.equal(t2d.nonzero()[:, 0], ids)):
        raise UserError(f"{source}: t2d does not mark the target ids d2t maps to")
    out["draft_ids"] = ids
    peagle = config.get("speculators_model_type") == "peagle" or bool(config.get("parallel_drafting"))
    proposal = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
    parallel = int(proposal.get("speculative_tokens") or 0) if peagle else 0
    if peagle and parallel < 2:
        where = ("speculators_config.proposal_methods[0].speculative_tokens is not >= 2" if layout == "speculators"
                 else "parallel_drafting is true, and vLLM's format does not record how many tokens one forward "
                      "drafts (the serving command's num_speculative_tokens); import its speculators export")
        raise UserError(f"{source}: a P-EAGLE head, but {where}")
    args = {"num_layers": 1, "aux_layers": tuple(_aux_ids(config, layout, asked, target, source)),
            "draft_vocab": draft_vocab,
            "fc_norm": bool(config.get("fc_norm")), "norm_output": bool(config.get("norm_output")),
            "parallel_drafts": parallel, "mask_token_id": int(config.get("mask_token_id", -1)),
            "window": _window(layer), "norm_before_residual": bool(config.get("norm_before_residual")),
            "norm_before_fc": bool(config.get("norm_before_fc", eagle.get("norm_before_fc")))}
    return args, out


def _eagle(config: dict, tensors: dict[str, torch.Tensor], target: ModelConfig, embed: torch.Tensor, source: str
           ) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-1 head's ``head_spec`` arguments and tensors (the engines' names are this toolkit's)."""
    _check_layer(config, target, source, "")
    out = {k.removeprefix("model."): v for k, v in tensors.items()}
    bias = out.pop("fc.bias", None)
    if bias is not None and bias.abs().max() > 0:
        raise UserError(f"{source}: fc.bias is not zero; this runtime's EAGLE-1 fc has no bias (vLLM's neither)")
    own = out.pop("embed_tokens.weight", None)
    if own is not None:
        _check_embedding(own, embed, source)
    out.pop("lm_head.weight", None)  # (the engines draft from the target's lm_head; the EAGLE repo's is the base's)
    layers = {int(k.split(".")[1]) for k in out if k.startswith("layers.")}
    return {"num_layers": max(layers) + 1 if layers else 0}, out


def _dflash(config: dict, tensors: dict[str, torch.Tensor], src: Path, target: ModelConfig, source: str
            ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A vLLM DFlash head's ``head_spec`` arguments and tensors, with its mask vector from ``mask_embedding.pt``."""
    _check_layer(config, target, source, "")
    dflash = config.get("dflash_config") or {}
    layers = dflash.get("target_layer_ids")
    if not layers:
        raise UserError(f"{source}: no dflash_config.target_layer_ids (the target layers it reads)")
    block = config.get("block_size")
    if not block:
        raise UserError(f"{source}: no block_size (the positions of the block it was trained on)")
    try:
        mask = torch.load(src / MASK_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{src / MASK_FILE}: not found; a DFlash head's mask vector is there") from None
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise UserError(f"{src / MASK_FILE}: cannot be read ({str(e).splitlines()[0][:120]})") from None
    out = dict(tensors)
    out["mask_embedding"] = mask["embedding"]
    window = int(dflash.get("swa_window_size") or 0) if dflash.get("use_swa") else 0
    return {"num_layers": int(config.get("num_hidden_layers", 1)), "aux_layers": tuple(int(i) + 1 for i in layers),
            "block_size": int(block), "mask_token_id": int(dflash.get("mask_token_id", mask["mask_token_id"])),
            "window": window}, out


def _check_embedding(embed: torch.Tensor, target_embed: torch.Tensor, source: str) -> None:
    """An embedding the file carries must be the target's, to bf16's rounding (the engines share the target's; a
    head trained against another one would draft from inputs it never saw)."""
    if embed.shape != target_embed.shape or not torch.allclose(embed.float(), target_embed, rtol=1e-2, atol=1e-3):
        raise UserError(f"{source}: embed_tokens.weight is not the target's embedding; the head was trained against "
                        "another one")


def import_head(src: Path, target_root: Path, target: ModelConfig, layout: str | None = None
                ) -> tuple[DraftHead, dict]:
    """The head at ``src`` for the target at ``target_root`` (config ``target``): the module, built and loaded as this
    runtime runs it, and the record of where it came from. ``layout`` names the engine a file was written for where
    its config cannot tell (``--layout``)."""
    if layout is not None and layout not in LAYOUTS:
        raise UserError(f"--layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    source = str(src)
    config, tensors = read_source(src)
    kind, found = detect(config, tensors, source)
    embed = FrozenTarget.load(target_root).embed_weight
    if kind == "eagle3":
        args, named = _eagle3(config, tensors, found, layout, target, embed, source)
    elif kind == "eagle":
        args, named = _eagle(config, tensors, target, embed, source)
    else:
        args, named = _dflash(config, tensors, src, target, source)
    layout = layout or found
    convention = "sglang" if layout == "sglang" else "vllm"
    spec = head_spec(kind, args.pop("num_layers"), target, target_fingerprint(target_root), convention, **args)
    head = head_from_hf(spec, named, source)
    unused = sorted(set(named) - set(head_to_hf(head)))
    if unused:
        raise UserError(f"{source}: tensor {unused[0]!r} is not part of the {kind} head this runtime builds for the "
                        "target")
    return head, {"source": str(src.resolve()), "layout": layout, "kind": kind}


def import_recipe_head(recipe: Recipe, src: Path, layout: str | None = None, name: str | None = None) -> Path:
    """``mtp-train import``: the head at ``src`` imported for the recipe's target, written as a trained head
    directory (``config.json`` with an ``imported`` record, ``model.safetensors``) at ``OUTPUT_DIR/imported/NAME``,
    atomically and holding that name's lock; returns that directory."""
    root = recipe.target.path
    target = ModelConfig.from_hf(find_checkpoint(root).config, str(root / "config.json"))
    out = recipe.output_dir / "imported" / (name or src.resolve().name)
    with exclusive(out.with_name(f".lock.{out.name}"), "import"):  # a second import of NAME refuses in one line
        head, record = import_head(src, root, target, layout)
        save_head(out, head, {"imported": record})
    return out
