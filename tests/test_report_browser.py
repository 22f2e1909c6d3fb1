"""The release report in a real browser: headless Chromium loads the tiny report (``bench/example_report``'s,
rendered again by this code) with no console error, decodes every plot, and shows the tables and the model-card
block on top (``bench/report_browser.py`` drives it).

Where Chromium is missing, the fixture installs Debian's package when it can (root and apt-get), as the SLURM tests
install their daemons; elsewhere the tests skip, saying why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from mtp_train.eval.plots import PLOTS
from mtp_train.eval.render import write_report
from mtp_train.eval.report import load_report

SCRIPT = REPO / "bench" / "report_browser.py"


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["timeout", "900", "apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # a stale package list
            subprocess.run(["timeout", "300", "apt-get", "update", "-q"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("no chromium on PATH, and it could not be installed here (needs root and apt-get)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (it is in the test extra: pip install -e '.[test]')")
    return path


def test_the_tiny_report_loads_in_chromium_with_every_plot_decoded(chromium, tmp_path):
    report = load_report(REPO / "bench" / "example_report" / "report.json")
    write_report(report, tmp_path)
    shot = tmp_path / "shot.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "report.html"), "--chromium", chromium,
                           "--screenshot", str(shot)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = json.loads(proc.stdout)
    assert page["errors"] == [], page["errors"]
    assert page["title"].startswith("Release report: mtp draft")
    assert [i["alt"] for i in page["images"]] == [PLOTS[k] for k in PLOTS], "every plot, in the report's order"
    assert all(i["decoded"] and i["width"] > 600 and i["height"] > 300 for i in page["images"]), page["images"]
    tables = (tmp_path / "report.html").read_text().count("<table>")
    assert page["tables"] == tables >= 5 and page["headings"][0] == "Model card", "every table is in the page"
    assert page["card"] == (tmp_path / "model_card.md").read_text() and "**Best measured speedup**" in page["card"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
