"""bench/gpu_check.py: its --cpu-smoke run goes through every section on CPU and prints the report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"


@pytest.mark.slow
def test_cpu_smoke_runs_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--work", str(tmp_path / "work")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + (tmp_path / "work" / "gpu_check.log").read_text()[-3000:]
    assert "FAIL" not in out
    for needle in ("## GPU check, ", "torch 2.", "flashinfer ", "### Attention backends: random target",
                   "| torch vs transformers | 1.0000 |", "| runtime, torch backend |", "| transformers generate |",
                   "### Pipeline on the random target (torch attention backend)", "verify: ./run/features",
                   "Train: mtp head, 3 steps", "| k | T | tau | alpha |", "Headline (k=",
                   "| torch over cached pages vs torch fresh | 1.0000 |", "Train: eagle3 head, 3 steps",
                   "| train:deepspeed | PASS |", "| precompute:regenerate | PASS |", "| pipeline:deepseek | PASS |",
                   "| train:online-fp8 | PASS |",
                   "SKIP precompute:tp2: not in --cpu-smoke", "SKIP parity:smollm2: not in --cpu-smoke",
                   "| section | result | seconds |", "| eval | PASS |", "**PASS**: 10/10 sections passed"):
        assert needle in out, needle
    # The sweep covers k = 1..2 at T = 0 and 1, and the report went to $OUT.
    for k, t in ((1, 0), (2, 0), (1, 1), (2, 1)):
        assert f"\n| {k} | {t} | " in out
    assert (tmp_path / "out" / "gpu_check.md").read_text().startswith("## GPU check, ")
    assert (tmp_path / "out" / "gpu_check.log").is_file()


def test_without_cuda_says_so_and_exits_0() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device here; nothing was measured. Run this on a GPU machine (or use --cpu-smoke)."
    ]
