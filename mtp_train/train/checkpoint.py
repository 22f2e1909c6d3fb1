"""Resumable training state and the final head directory, all written atomically.

A checkpoint is ``checkpoints/step-NNNNNNNN/`` with ``head.safetensors`` (trainable tensors),
``optimizer.pt`` and ``rng.pt`` (tensor-only, loaded with ``weights_only=True``) and
``state.json`` (step, data position, scheduler). It is written to a temp directory and renamed;
then the ``latest`` pointer is replaced; the oldest checkpoints beyond ``keep`` are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mtp_train.errors import UserError
from mtp_train.heads.base import DraftHead, HeadSpec, build_head, load_head_config
from mtp_train.models.checkpoint import layer_from_hf, layer_to_hf
from mtp_train.models.config import ModelConfig
from precompute.manifest import write_json_atomic

LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, head: DraftHead, optimizer, scheduler, state: dict[str, Any],
                    keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, tmp / "head.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    write_json_atomic(tmp / "state.json", {**state, "step": step, "scheduler": scheduler.state_dict()})
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    (root / f".{LATEST}.tmp").write_text(final.name)
    os.replace(root / f".{LATEST}.tmp", root / LATEST)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(root: Path, head: DraftHead, optimizer, scheduler) -> dict[str, Any] | None:
    """Restore from ``latest`` if there is one; returns the saved state, or None for a fresh start."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    try:
        head.load_state_dict(load_file(path / "head.safetensors"))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        rng = torch.load(path / "rng.pt", weights_only=True)
        state = json.loads((path / "state.json").read_text())
    except Exception as e:  # a missing, truncated or foreign file
        raise UserError(f"{path}: checkpoint is corrupt or incomplete ({str(e).splitlines()[0][:160]}); "
                        f"delete it and point {pointer} at an older one, or start over") from None
    scheduler.load_state_dict(state.pop("scheduler"))
    torch.set_rng_state(rng["torch"])
    return state


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
        out.update({f"layers.{index}.{k}": v for k, v in layer_to_hf(state, head.spec.target).items()})
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
        state.update({prefix + k: v for k, v in layer_from_hf(layer, suffixes, source).items()})
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
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(head_to_hf(head), tmp / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(tmp / "config.json", {**head.spec.to_json(), **extra})
    _fsync_dir(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


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
    except Exception as e:
        raise UserError(f"{path}: cannot be read ({str(e).splitlines()[0][:160]})") from None
    return head_from_hf(spec, tensors, str(path)).eval()
