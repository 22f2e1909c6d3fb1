"""A real, non-editable install of the project: it claims no top-level name but ``mtp_train`` (the stages install
as ``mtp_train.precompute`` and ``mtp_train.eval``), holds every package of the tree, and runs from outside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO

FOLDERS = {"mtp_train": "mtp_train", "precompute": "mtp_train.precompute", "eval": "mtp_train.eval"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``pip install --target`` of a copy of the sources (the checkout itself is left as it is), offline."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(tmp / "site"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "site"


def _tree_packages() -> set[str]:
    return {".".join([package, *p.parent.relative_to(REPO / folder).parts])
            for folder, package in FOLDERS.items() for p in (REPO / folder).rglob("__init__.py")}


def test_pyproject_lists_every_package_of_the_tree():
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(listed) == sorted(_tree_packages())


def test_install_claims_no_top_level_eval_or_precompute(site):
    top = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")} - {"bin"}
    assert top == {"mtp_train"}
    installed = {".".join(p.parent.relative_to(site).parts) for p in site.rglob("__init__.py")}
    assert installed == _tree_packages()
    for name in ("small_rows.cpp", "paged_attention.cpp", "decode_layer.cpp", "kernels.h"):  # package data
        assert (site / "mtp_train" / "runtime" / name).is_file(), name


def test_installed_command_runs_from_outside_the_checkout(site, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import mtp_train.eval.run as e, mtp_train.precompute.run as p; "
                            "print(e.__file__); print(p.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                           text=True)
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split()), where.stdout
    dry = subprocess.run([str(site / "bin" / "mtp-train"), str(REPO / "recipes" / "tiny.yaml"), "--dry-run",
                          f"output_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert dry.returncode == 0 and "plan:" in dry.stdout, dry.stderr
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
