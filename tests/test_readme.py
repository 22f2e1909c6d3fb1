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


RESULTS = (REPO / "bench" / "RESULTS.md").read_text()
# A figure is a number standing on its own: digits, thousands groups and decimals (12,057, 0.255, the 1.13 of
# 1.13× or 2.26x), never part of a name or identifier (SmolLM2, bf16, Llama-3-70B, top-32, 1e-4).
FIGURE = re.compile(r"(?<![\w.])(?<!\w-)\d+(?:,\d{3})*(?:\.\d+)?(?!(?!x\b)\w|[.,]\d|-\w)")


def _figures(text: str) -> set[str]:
    return set(FIGURE.findall(text))


def _results_rows() -> list[list[str]]:
    section = README.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 2 and set(rows[1][0].strip()) <= set("-:"), "README's results table lost its header"
    rows = [[cell.strip() for cell in row] for row in rows[2:]]
    assert all(len(row) == 3 for row in rows), "a row of README's results table has other than three cells"
    return rows


def _results_sections() -> dict[str, str]:
    """bench/RESULTS.md's `##` and `###` sections by heading, outside code blocks; a section's text runs from its
    heading to the next heading of its own level or above, so it holds its subsections."""
    lines, heads, fenced = RESULTS.splitlines(), [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+) (.+)", line)):
            heads.append((i, len(m[1]), m[2].strip()))
    sections = {}
    for n, (i, level, heading) in enumerate(heads):
        end = next((j for j, other, _ in heads[n + 1:] if other <= level), len(lines))
        if level in (2, 3):
            sections[heading] = "\n".join(lines[i:end])
    return sections


def test_every_results_row_cites_a_section_that_holds_its_figures():
    """Each row of the README's results table names, in its last column, the one `##` or `###` heading of
    bench/RESULTS.md that starts with that name, and every figure of the row's first two cells (what was measured,
    with its settings, and the result) appears as a figure in that section's text. Settings count too (k = 1..4,
    61 min, 1,280 answers): a row may quote only what its section says, verbatim, rounding included."""
    sections = _results_sections()
    rows = _results_rows()
    assert len(rows) >= 5, "README's results table has fewer than five rows"
    problems = []
    for what, result, cited in rows:
        matches = [heading for heading in sections if heading.startswith(cited)]
        if len(matches) != 1:
            problems.append(f"{cited!r}: {len(matches)} headings of bench/RESULTS.md start with it ({matches})")
            continue
        missing = sorted(_figures(what + " " + result) - _figures(sections[matches[0]]))
        if missing:
            problems.append(f"{cited!r}: figures not in that section: {missing}")
    assert not problems, "README's results table and bench/RESULTS.md disagree:\n" + "\n".join(problems)
