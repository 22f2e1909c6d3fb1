"""bench/scaling.py pairs: two heads' τ compared seed by seed (the same eval prompts), mean ± SE of the differences;
and a point's settings, which leave out fields added later while they hold their old value."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _point(head: str, seed: int, tau: float) -> dict:
    return {"recipe": "tiny.yaml", "head": head, "budget_m": 1.0, "seed": seed, "settings": {}, "tokens": 1_000_000,
            "tau_k4": tau}


def test_pairs_differences_by_seed(tmp_path: Path) -> None:
    rows = [_point("mtp", s, t) for s, t in enumerate((2.0, 2.1, 2.2))]
    rows += [_point("eagle3", s, t) for s, t in enumerate((1.8, 1.95, 2.0))]
    rows += [_point("eagle", 0, 1.9)]  # one seed shared with each: no pair
    path = tmp_path / "points.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "scaling.py"), "pairs", str(path)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # differences 0.20, 0.15, 0.20: mean 0.183, SE 0.0289 / sqrt(3) = 0.017, 11.0 SE; unpaired SE 0.083: 2.2
    assert lines == ["| mtp | eagle3 | 1.00M | 3 | 0.183 ± 0.017 | 11.0 | 0.183, 2.2 |"]


def test_a_points_settings_leave_out_later_fields_at_their_old_value() -> None:
    spec = importlib.util.spec_from_file_location("scaling", REPO / "bench" / "scaling.py")
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    later = {"train.optimizer", "train.lr_schedule", "head.norm_before_fc", "head.norm_before_residual"}
    assert not later & set(scaling.settings(REPO / "recipes" / "tiny.yaml", "eagle3", []))  # points stored before
    changed = scaling.settings(REPO / "recipes" / "tiny.yaml", "eagle3",
                               ["train.optimizer=muon", "train.lr_schedule=linear", "head.norm_before_residual=true"])
    assert (changed["train.optimizer"], changed["train.lr_schedule"], changed["head.norm_before_residual"]) == (
        "muon", "linear", True)
