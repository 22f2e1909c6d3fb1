"""The README stays true: its recipe reference is the schema's, its quick start is two commands."""

from __future__ import annotations

import re

from conftest import REPO
from mtp_train.tools.recipe_reference import reference_markdown

README = (REPO / "README.md").read_text()


def test_recipe_reference_matches_the_schema():
    begin, end = "<!-- recipe-reference:begin -->\n", "<!-- recipe-reference:end -->"
    section = README.split(begin, 1)[1].split(end, 1)[0]
    assert section.strip() == reference_markdown().strip(), (
        "README's recipe reference is stale: paste the output of "
        "`.venv/bin/python -m mtp_train.tools.recipe_reference`"
    )


def test_quick_start_is_two_commands_that_exist_in_the_makefile():
    block = README.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [line for line in block.splitlines()[1:] if line.strip() and not line.startswith("#")]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
