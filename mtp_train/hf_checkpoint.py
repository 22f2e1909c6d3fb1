"""Locate and sanity-check an HF-format checkpoint directory without importing torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError

SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# the decoder families mtp_train.models implements
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class CheckpointFiles:
    """What an HF checkpoint directory holds."""

    root: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: {what} is not valid JSON (line {e.lineno}): {e.msg}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: {what} must be a JSON object")
    return data


def require_family(hf: dict[str, Any], source: str) -> str:
    """The config's ``model_type``; an unsupported one is refused, listing the supported families."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{source}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    return family


def find_checkpoint(root: Path, field: str = "target.path") -> CheckpointFiles:
    """Check that ``root`` holds a config and safetensors weights; name ``field`` in errors."""
    if not root.is_dir():
        raise UserError(f"{field}: checkpoint directory {root} not found")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise UserError(f"{field}: {config_path} not found; an HF checkpoint needs config.json")
    config = _read_json(config_path, "config.json")
    if (root / SINGLE_WEIGHTS).is_file():
        files: tuple[Path, ...] = (root / SINGLE_WEIGHTS,)
    elif (root / WEIGHTS_INDEX).is_file():
        index = _read_json(root / WEIGHTS_INDEX, "weight index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{root / WEIGHTS_INDEX}: key 'weight_map' is missing or empty")
        files = tuple(root / name for name in sorted(set(weight_map.values())))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{root / WEIGHTS_INDEX}: weight file {missing[0]} listed in 'weight_map' is missing")
    else:
        raise UserError(f"{field}: no {SINGLE_WEIGHTS} or {WEIGHTS_INDEX} in {root}; only safetensors weights load")
    return CheckpointFiles(root=root, config=config, weight_files=files)


def check_target(ckpt: CheckpointFiles, tp: int, field: str = "target.tp") -> None:
    """Refuse an unsupported family first, then a TP degree that does not divide the attention or KV heads, or the
    MLP or expert channels."""
    require_family(ckpt.config, str(ckpt.root / "config.json"))
    heads = int(ckpt.config.get("num_attention_heads", 0))
    kv_heads = int(ckpt.config.get("num_key_value_heads", heads))
    if heads <= 0:
        raise UserError(f"{ckpt.root / 'config.json'}: key 'num_attention_heads' is missing or not positive")
    channels = [("MLP channels", int(ckpt.config.get("intermediate_size") or 0))]
    if ckpt.config.get("moe_intermediate_size"):
        channels.append(("expert channels", int(ckpt.config["moe_intermediate_size"])))
    for name, n in (("attention heads", heads), ("KV heads", kv_heads), *channels):
        if n % tp:
            raise UserError(f"{field}: {tp} does not divide the target's {n} {name}; choose a divisor of {n}")
