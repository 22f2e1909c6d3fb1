"""bench/length_table.py: α₁ pooled by context length and over the short sets, weighted by verify steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mtp_train.eval.report import Group
from test_report import _point, make_report

REPO = Path(__file__).resolve().parents[1]


def _group(alpha: float, steps: int) -> Group:
    return Group(num_prompts=2, tau=1.0 + alpha, alpha=[alpha], distinct2=0.9, num_steps=steps)


def _table(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "length_table.py"), str(path)], capture_output=True,
                          text=True)


def test_the_groups_pool_by_steps_and_the_ratio_reads_4_8k_over_under_1k(tmp_path: Path) -> None:
    chain = _point(1, 0.0).model_copy(update={
        "by_length": {"0-127": _group(0.2, 300), "512-1023": _group(0.4, 100), "1024-2047": _group(0.9, 50),
                      "2048-4095": _group(0.1, 40), "4096-8191": _group(0.35, 60)},
        "by_prompt_set": {"spec_bench": _group(0.25, 200), "mt_bench": _group(0.3, 300), "long": _group(0.9, 9)}})
    path = tmp_path / "report.json"
    path.write_text(make_report(sweep=[_point(2, 0.0), chain]).model_dump_json())
    proc = _table(path)
    assert proc.returncode == 0, proc.stderr
    cells = proc.stdout.splitlines()[2].split(" | ")
    # under 1k: (0.2*300 + 0.4*100) / 400 = 0.25; 4-8k: (0.1*40 + 0.35*60) / 100 = 0.25; short: 0.28 over 500 steps
    assert cells[1:] == ["0.250 ± 0.022 (400)", "0.100 ± 0.047 (40)", "0.350 ± 0.062 (60)", "0.250 ± 0.043 (100)",
                         "1.00", "0.280 ± 0.020 (500) |"]


def test_a_missing_or_foreign_report_is_one_line_and_exit_2(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"sweep": [{"k": 2, "temperature": 0.0}]}')
    no_chain = tmp_path / "no_chain.json"
    no_chain.write_text(make_report(sweep=[_point(2, 0.0)]).model_dump_json())
    for path in (tmp_path / "absent.json", foreign, no_chain):
        proc = _table(path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and str(path) in proc.stderr and "Traceback" not in proc.stderr
