"""Resumable training state and the final head directory, all written atomically.

A checkpoint is ``checkpoints/step-NNNNNNNN/`` with ``head.safetensors`` (trainable tensors),
``optimizer.rank-RRRRR.pt`` (one per rank under DeepSpeed ZeRO, whose optimizer state is
partitioned; one from rank 0 under DDP, whose replicas are identical), ``rng.pt`` (all tensor-only,
loaded with ``weights_only=True``) and ``state.json`` (step, data position, scheduler, number of
optimizer shards). Every rank writes into one temp directory; rank 0 then renames it, replaces the
``latest`` pointer and deletes the oldest checkpoints beyond ``keep``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mtp_train.errors import UserError
from mtp_train.heads.base import DraftHead, HeadSpec, build_head, head_spec, load_head_config
from mtp_train.heads.deepseek_layout import from_deepseek
from mtp_train.hf_checkpoint import find_checkpoint
from mtp_train.io import fresh_dir, replace_dir, write_atomic, write_json_atomic
from mtp_train.models.checkpoint import layer_from_hf, layer_to_hf, read_tensors, weight_locations
from mtp_train.models.config import ModelConfig
from mtp_train.features.manifest import target_fingerprint, text_fingerprint

LATEST = "latest"


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def _optimizer_file(path: Path, rank: int) -> Path:
    return path / f"optimizer.rank-{rank:05d}.pt"


def begin_checkpoint(root: Path, step: int) -> Path:
    """Rank 0, before any rank writes: a fresh temp directory for step ``step``."""
    return fresh_dir(_tmp_dir(root, step))


def save_optimizer_shard(root: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Every rank that owns optimizer state: its (tensor-only) state into the step's temp directory."""
    path = _optimizer_file(_tmp_dir(root, step), rank)
    torch.save(state, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def finish_checkpoint(root: Path, step: int, head: DraftHead, scheduler, state: dict[str, Any], shards: int,
                      keep: int) -> Path:
    """Rank 0, after every rank saved its optimizer shard: the rest, then rename, ``latest`` and rotation."""
    final, tmp = root / f"step-{step:08d}", _tmp_dir(root, step)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, tmp / "head.safetensors")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    write_json_atomic(tmp / "state.json", {**state, "step": step, "scheduler": scheduler.state_dict(),
                                           "optimizer_shards": shards})
    replace_dir(tmp, final)
    write_atomic(root / LATEST, final.name)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# What reading a missing, truncated or foreign file raises (ValueError: bad JSON or UTF-8; KeyError: an entry
# missing). Code bugs raise other errors and surface as tracebacks.
UNREADABLE = (OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError)


def _corrupt(file: Path, pointer: Path, e: Exception) -> UserError:
    """One line naming the damaged file of a checkpoint and what to do."""
    detail = (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
    return UserError(f"{file}: checkpoint is corrupt or incomplete ({detail}); delete {file.parent} and point "
                     f"{pointer} at an older one, or start over")


def _load_pt(path: Path) -> Any:
    """A tensor-only ``torch.load``; torch's zip reader reports a truncated or foreign file as a RuntimeError,
    turned here into a ValueError (one of ``UNREADABLE``)."""
    try:
        return torch.load(path, weights_only=True)
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def _load_state(path: Path) -> dict[str, Any]:
    """``state.json``; anything but an object with an integer ``step`` and a ``scheduler`` is a ValueError."""
    state = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "scheduler" not in state:
        raise ValueError("not a checkpoint's state: a JSON object with 'step' and 'scheduler'")
    return state


def load_checkpoint(root: Path, head: DraftHead, scheduler) -> tuple[Path, dict[str, Any]] | None:
    """Restore the head, scheduler and RNG from ``latest`` if there is one: ``(its directory, saved state)``.

    The optimizer is restored separately, once it is prepared, by ``load_optimizer_shard``.
    """
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        path = root / pointer.read_text(encoding="utf-8").strip()
    except UNREADABLE as e:
        raise UserError(f"{pointer}: not a checkpoint name ({e}); write the name of a step-* directory into it, "
                        f"or delete {root} to start over") from None
    if not path.name.startswith("step-") or not path.is_dir():
        raise UserError(f"{pointer}: names {path.name!r}, which is not a checkpoint directory here; write the name "
                        f"of a step-* directory into it, or delete {root} to start over")
    file = path / "head.safetensors"
    try:
        tensors = load_file(file)
        head.load_state_dict(tensors)
        file = path / "rng.pt"
        rng = _load_pt(file)["torch"]
        torch.set_rng_state(rng)
        file = path / "state.json"
        state = _load_state(file)
        scheduler.load_state_dict(state.pop("scheduler"))
    except (*UNREADABLE, RuntimeError, TypeError) as e:  # RuntimeError, TypeError: another head's tensors or state
        raise _corrupt(file, pointer, e) from None
    return path, state


def load_optimizer_shard(path: Path, state: dict[str, Any], rank: int, world: int, sharded: bool,
                         optimizer: str) -> dict[str, Any]:
    """This rank's optimizer state from checkpoint ``path`` (rank 0's when the state is replicated), which must be
    that of ``optimizer`` (``train.optimizer``; a checkpoint that names none is AdamW's)."""
    shards, saved = int(state.get("optimizer_shards", 1)), state.get("optimizer", "adamw")
    if saved != optimizer:
        raise UserError(f"{path}: the checkpoint holds {saved}'s state and the recipe asks for train.optimizer "
                        f"{optimizer}; resume with train.optimizer={saved}, or start over")
    if sharded and shards != world:
        raise UserError(f"{path}: the checkpoint's optimizer state is split over {shards} ZeRO rank(s); "
                        f"resume with {shards} process(es), or start over")
    if not sharded and shards != 1:
        raise UserError(f"{path}: the checkpoint was written by DeepSpeed ZeRO ({shards} optimizer shards); "
                        f"resume with train.engine=deepspeed")
    file = _optimizer_file(path, rank if sharded else 0)
    try:
        return _load_pt(file)
    except UNREADABLE as e:
        raise _corrupt(file, path.parent / LATEST, e) from None


def head_to_hf(head: DraftHead) -> dict[str, torch.Tensor]:
    """Trainable head tensors in DeepSeek/HF names: ``enorm``, ``hnorm``, ``eh_proj`` (or EAGLE's ``fc``),
    ``shared_head.norm`` and ``layers.{i}.`` + the HF decoder-layer names (``self_attn.q_proj``, ...)."""
    out, layers = {}, {}
    for name, tensor in head.state_dict().items():
        if name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            layers.setdefault(int(index), {})[suffix] = tensor
        elif not name.startswith("rope."):
            out[name] = tensor.detach().contiguous()
    for index, state in layers.items():
        out.update({f"layers.{index}.{k}": v for k, v in layer_to_hf(state, head.layer_config()).items()})
    return out


def head_from_hf(spec: HeadSpec, tensors: dict[str, torch.Tensor], source: str) -> DraftHead:
    head = build_head(spec)
    state = {}
    wanted: dict[int, list[str]] = {}
    for name in head.state_dict():
        if name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            wanted.setdefault(int(index), []).append(suffix)
        elif name in tensors:
            state[name] = tensors[name]
    for index, suffixes in wanted.items():
        prefix = f"layers.{index}."
        layer = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        state.update({prefix + k: v for k, v in layer_from_hf(layer, suffixes, source, head.layer_config()).items()})
    missing = sorted(set(head.state_dict()) - set(state))
    if missing:
        raise UserError(f"{source}: head tensor {missing[0]!r} is missing")
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:160])
        raise UserError(f"{source}: tensors do not fit the head's config ({detail})") from None
    return head


def save_head(out: Path, head: DraftHead, extra: dict[str, Any]) -> None:
    """The final HF-style head directory: ``config.json`` + ``model.safetensors``, replaced atomically."""
    tmp = fresh_dir(out.with_name(f".{out.name}.tmp"))
    save_file(head_to_hf(head), tmp / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(tmp / "config.json", {**head.spec.to_json(), **extra})
    replace_dir(tmp, out)


def load_head(root: Path, target: ModelConfig | None = None) -> DraftHead:
    """A saved head directory -> the head module (fp32, eval mode), checked against ``target`` if given."""
    spec = load_head_config(root)
    if target is not None and (spec.target.hidden_size, spec.target.vocab_size) != (target.hidden_size, target.vocab_size):
        raise UserError(
            f"{root / 'config.json'}: head was built for hidden size {spec.target.hidden_size} and vocab "
            f"{spec.target.vocab_size}, the target has {target.hidden_size} and {target.vocab_size}"
        )
    path = root / "model.safetensors"
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise UserError(f"{path}: cannot be read ({str(e).splitlines()[0][:160]}); "
                        "train the head again with `mtp-train train`") from None
    return head_from_hf(spec, tensors, str(path)).eval()


def load_trained_head(root: Path, target_root: Path, target: ModelConfig) -> DraftHead:
    """``load_head`` checked against the target checkpoint at ``target_root`` (config ``target``): refused when the
    head was trained for another target."""
    head = load_head(root, target)
    if head.spec.target_fingerprint != target_fingerprint(target_root):
        raise UserError(f"{root / 'config.json'}: the head was trained for a different target than "
                        f"{target_root}; train it again for this target")
    return head


def head_identity(root: Path) -> str:
    """A head directory's identity, what a run that reads it depends on: its config's fingerprint and its weights'
    size; refused in one line where it holds no head."""
    weights, config = root / "model.safetensors", root / "config.json"
    if not weights.is_file() or not config.is_file():
        raise UserError(f"{root}: no head here (config.json and model.safetensors)")
    return "head:" + text_fingerprint(config.read_text(errors="replace")) + str(weights.stat().st_size)


# Fields added after heads were trained, at the value every earlier head had: left out of the fingerprint there,
# so that those heads' keys are unchanged.
LATER_TRAIN_FIELDS = {"optimizer": "adamw", "lr_schedule": "cosine", "freeze_lm_head": False}
LATER_HEAD_FIELDS = {"norm_before_fc": False, "norm_before_residual": False}


def training_fingerprint(recipe: Any, features: dict[str, Any], init_from: str | None) -> str:
    """What a finished head records as its training (``head_is_complete``): the train and head sections, the seed, the
    features' fingerprint and an initial head's identity. The τ probe's settings measure the head and do not change
    it; fields added later (``LATER_TRAIN_FIELDS``, ``LATER_HEAD_FIELDS``) count only where they differ from what
    every earlier head had."""
    train = without_later(recipe.train.model_dump(mode="json", exclude={"tau_every", "tau_prompts", "tau_tokens"}),
                          LATER_TRAIN_FIELDS)
    head = without_later(recipe.head.model_dump(mode="json"), LATER_HEAD_FIELDS)
    return text_fingerprint(json.dumps({"recipe_train": train, "head": head, "seed": recipe.seed,
                                        "features": features, "init_from": init_from}, sort_keys=True))


def without_later(section: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """``section`` without the fields of ``later`` that hold the value ``later`` gives them."""
    return {k: v for k, v in section.items() if k not in later or v != later[k]}


def head_is_complete(root: Path, training_fingerprint: str) -> bool:
    """Whether ``root`` holds the head of this training: its config names ``training_fingerprint`` and its
    ``model.safetensors`` is whole (its header covers the file). A damaged head is not complete: training again
    rewrites it."""
    try:
        config = json.loads((root / "config.json").read_text())
        with safe_open(root / "model.safetensors", framework="pt"):
            pass
    except (OSError, ValueError, SafetensorError):
        return False
    return isinstance(config, dict) and config.get("training_fingerprint") == training_fingerprint


def target_mtp_layers(root: Path, cfg: ModelConfig) -> int:
    """The MTP layers of the checkpoint at ``root`` (target config ``cfg``), refused when it has none: its config.json
    decides, so ``mtp_train.pipeline.check_recipe`` asks before any stage runs when the eval drafts with them."""
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    n = int(config.get("num_nextn_predict_layers") or 0)
    if not cfg.family.startswith("deepseek") or n == 0:
        raise UserError(f"{root / 'config.json'}: eval.draft target_mtp needs a DeepSeek-V3-layout checkpoint with "
                        f"num_nextn_predict_layers >= 1 (this one: model_type {cfg.family!r}, {n} MTP layers); "
                        "train a head instead (eval.draft: head)")
    return n


def load_target_mtp(root: Path, cfg: ModelConfig, fingerprint: str, index: int = 0) -> DraftHead:
    """MTP layer ``index`` of the checkpoint at ``root`` (target config ``cfg``) as a head (fp32, eval mode), in
    the vLLM convention (the target's hidden state after its final norm, the state after ``shared_head.norm`` fed
    back, the embedding zeroed at position 0), as DeepSeek's MTP layers are served."""
    n = target_mtp_layers(root, cfg)
    if index >= n:
        raise UserError(f"{root / 'config.json'}: MTP layer {index} asked for, the checkpoint has {n}")
    layer = cfg.num_layers + index
    prefix = f"model.layers.{layer}."
    names = [k for k in weight_locations(find_checkpoint(root)) if k.startswith(prefix)]
    if not names:
        raise UserError(f"{root}: config.json says {n} MTP layer(s), but no tensor {prefix}* is in the checkpoint")
    spec = head_spec("mtp", 1, cfg, fingerprint, "vllm")
    tensors = from_deepseek(read_tensors(root, names, torch.float32), layer)
    return head_from_hf(spec, tensors, f"{root} (MTP layer {prefix}*)").eval()
