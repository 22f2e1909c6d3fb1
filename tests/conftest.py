"""Shared fixtures: the repo root, the tiny default, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO / "recipes" / "tiny" / "target"
TINY_RECIPE = REPO / "recipes" / "tiny.yaml"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def run_cli(*args: str | os.PathLike[str], cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``mtp-train ARGS`` in a real subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "mtp_train.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli
