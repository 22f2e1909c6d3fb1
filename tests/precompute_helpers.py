"""Small precompute runs on the tiny target, for the precompute tests."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO, TINY_TARGET


def sgd_rows(n: int, split: str = "dev") -> list[dict]:
    with gzip.open(REPO / f"data/sgd/sgd_{split}_sharegpt.jsonl.gz", "rt") as f:
        return [json.loads(next(f)) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_recipe(tmp: Path, data_file: Path, **overrides) -> Path:
    """A recipe in ``tmp`` over ``data_file`` with small shards; ``overrides`` are ``section={key: value}``."""
    recipe = {
        "output_dir": str(tmp / "run"),
        "target": {"path": str(TINY_TARGET), "dtype": "float32"},
        "data": {"train": str(data_file), "max_length": 256, "heldout_rows": 4},
        "precompute": {"layers": [1, -1], "topk": 8, "shard_tokens": 3000, "batch_tokens": 2048},
    }
    for section, values in overrides.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_precompute_cli(recipe: Path, *args: str, crash_at: str | None = None, timeout: float = 300):
    env = dict(os.environ)
    env.pop("MTP_TRAIN_CRASH_AT", None)
    if crash_at:
        env["MTP_TRAIN_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-m", "mtp_train.cli", "precompute", str(recipe), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def shard_contents(features: Path) -> dict[int, dict]:
    """Every stored row's tensors, keyed by row id."""
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features)
    return {ref.row_id: reader.load(ref) for ref in reader.sequences}


def other_target(tmp: Path) -> Path:
    """A copy of the tiny target whose config differs (so its fingerprint differs), in ``tmp/other_target``."""
    import shutil

    other = tmp / "other_target"
    shutil.copytree(TINY_TARGET, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    return other
