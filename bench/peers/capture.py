"""Offline EAGLE-3 target features in SpecForge 0.2.0's offline format, captured with a plain transformers forward.

SpecForge's own capture (``scripts/prepare_hidden_states.py``, not in its wheel) runs the target in SGLang, which
needs CUDA. This does the same capture on the CPU: forward hooks keep the residual stream after the blocks
``[1, L//2 - 1, L - 4]`` (SpecForge's ``resolve_eagle_capture_layers``, "output of block k"; the same tensors as
``output_hidden_states[k + 1]``) and the base model's output is the final normed state (``output_hidden_states[L]``),
what SGLang hands its logits processor and SpecForge stores as ``hidden_state``.

One file per conversation, ``rows_{a}-{b}/data_{i}.ckpt`` as SpecForge's script names them, holding
``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, 3H]
(the low, mid and high states concatenated). Imports nothing of SpecForge, so the project's ``.venv`` can test it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

GROUP = 5000  # conversations per rows_{a}-{b} folder, as in SpecForge's prepare_hidden_states.py


def capture_layers(num_layers: int) -> list[int]:
    """SpecForge's default EAGLE-3 aux layers for an ``num_layers``-block target: outputs of these blocks."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@torch.no_grad()
def capture(model: Any, input_ids: torch.Tensor, layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux and final states of one forward of a HF decoder-only ``model`` (``LlamaForCausalLM``-like).

    ``input_ids``: int64 [B, T] (no padding). Returns ``aux`` [B, T, 3H], the residual after each block in
    ``layers`` (default :func:`capture_layers`) concatenated in that order, and ``last`` [B, T, H], the final
    normed state. The language-model head never runs.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = capture_layers(len(base.layers)) if layers is None else layers
    kept: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(_module: Any, _args: Any, output: Any) -> None:
            kept[index] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [base.layers[i].register_forward_hook(keep(i)) for i in layers]
    try:
        last = base(input_ids=input_ids, use_cache=False).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([kept[i] for i in layers], dim=-1), last


def feature_path(out_dir: str | Path, index: int) -> Path:
    """Where conversation ``index`` goes: ``OUT/rows_{a}-{b}/data_{index}.ckpt``."""
    start = index // GROUP * GROUP
    return Path(out_dir) / f"rows_{start}-{start + GROUP}" / f"data_{index}.ckpt"


def write_features(model: Any, rows: list[dict], out_dir: str | Path, max_length: int,
                   dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """Capture each row (``{"input_ids": [...], "loss_mask": [...]}``, cut to ``max_length``) one at a time, unpadded.

    Writes SpecForge's offline files under ``out_dir`` with the states cast to ``dtype`` (SpecForge stores the
    target's compute dtype; its trainer feeds them to the draft without a cast). Returns (bytes on disk, tokens).
    """
    total_bytes = tokens = 0
    for index, row in enumerate(rows):
        ids = torch.tensor(row["input_ids"][:max_length], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"][:max_length], dtype=torch.long)
        aux, last = capture(model, ids[None])
        path = feature_path(out_dir, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"input_ids": ids, "loss_mask": mask, "hidden_state": last.to(dtype).contiguous(),
                  "aux_hidden_state": aux.to(dtype).contiguous()}
        torch.save(record, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        total_bytes += path.stat().st_size
        tokens += int(ids.numel())
    return total_bytes, tokens


def read_rows(path: str | Path, max_length: int) -> list[dict]:
    """The tokenized conversations of a JSONL file (``{"input_ids": [...], "loss_mask": [...]}`` per line), each cut
    to ``max_length`` tokens (ids and mask alike); a row whose two lists differ in length stops the run."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if len(row["input_ids"]) != len(row["loss_mask"]):
                raise SystemExit(f"{path}: input_ids and loss_mask differ in length")
            rows.append({k: row[k][:max_length] for k in ("input_ids", "loss_mask")})
    return rows
