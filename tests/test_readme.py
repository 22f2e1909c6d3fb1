"""The README stays true and short: its quick start is two commands, it fits in a few minutes' reading, and every
file it links to exists; the recipe reference in docs/recipes.md is the schema's."""

from __future__ import annotations

import re

from conftest import REPO
from mtp_train.tools.recipe_reference import reference_markdown

README = (REPO / "README.md").read_text()
MAX_README_LINES = 250


def test_recipe_reference_matches_the_schema():
    begin, end = "<!-- recipe-reference:begin -->\n", "<!-- recipe-reference:end -->"
    page = (REPO / "docs" / "recipes.md").read_text()
    assert begin in page and end in page, "docs/recipes.md lost its recipe-reference markers"
    section = page.split(begin, 1)[1].split(end, 1)[0]
    assert section.strip() == reference_markdown().strip(), (
        "docs/recipes.md's recipe reference is stale: paste the output of "
        "`.venv/bin/python -m mtp_train.tools.recipe_reference` between its markers"
    )


def test_quick_start_is_two_commands_that_exist_in_the_makefile():
    block = README.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [line for line in block.splitlines()[1:] if line.strip() and not line.startswith("#")]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, over {MAX_README_LINES}: move reference material to docs/")


def _links(text: str) -> list[str]:
    """Markdown link targets, without their #anchors, other than web addresses and in-page anchors."""
    targets = (t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text))
    return [t for t in targets if t and not re.match(r"[a-z]+:", t)]


def test_every_file_the_readme_links_to_exists():
    links = _links(README)
    assert "docs/recipes.md" in links, "README no longer links the recipe reference"
    missing = [t for t in links if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ holds no pages"
    unlinked = [p for p in pages if p not in _links(README)]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def test_every_file_the_docs_link_to_exists():
    missing = [f"{page.name}: {t}" for page in sorted((REPO / "docs").glob("*.md"))
               for t in _links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"docs pages link to files that do not exist: {missing}"


def test_every_repository_path_the_readme_names_exists():
    """Paths in backticks under the tracked folders (not what a run writes: runs/, .cache/, .venv/)."""
    roots = ("mtp_train/", "precompute/", "eval/", "recipes/", "data/", "bench/", "slurm/", "tests/", "docs/", ".ci/")
    named = {p for p in re.findall(r"`([\w.-]+/[\w./-]*)`", README) if p.startswith(roots)}
    assert "recipes/tiny.yaml" in named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"
