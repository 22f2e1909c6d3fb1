"""The house rules: parts import only downward (README, "Layout"), no module cycle, no base or training module
imports a stage, no product function over 80 lines, no Python file over 400 lines.

Every import counts, wherever it stands: at the top, inside a function, or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the package it installs as (pyproject.toml's package-dir): the stages live at the root.
PACKAGES = {"mtp_train": "mtp_train", "precompute": "mtp_train.precompute", "eval": "mtp_train.eval"}
MAX_LINES = 400
MAX_FUNCTION_LINES = 80
BASE = ("errors", "io", "lock", "recipe", "hf_checkpoint", "progress", "threads", "models", "heads", "runtime",
        "features", "data")
STAGES = ("mtp_train.precompute", "mtp_train.eval")


def _module(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([PACKAGES[folder], *rest]).removesuffix(".__init__")


def _sources() -> dict[str, Path]:
    return {_module(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that ``module`` imports; ``from a import b`` names ``a.b`` when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: one dot is the package itself, each further dot one package up
                names = package.split(".")
                base = ".".join(names[: len(names) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {name for name in found if name.split(".")[0] == "mtp_train" and name != module}


def module_graph() -> dict[str, set[str]]:
    sources = _sources()
    return {module: _imported(module, path, set(sources)) for module, path in sources.items()}


def part(module: str) -> str:
    """``mtp_train.<subpackage or module>`` (the stages are ``mtp_train.precompute`` and ``mtp_train.eval``)."""
    return ".".join(module.split(".")[:2])


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        graph.setdefault(part(module), set()).update(part(t) for t in targets if part(t) != part(module))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    return next((c for c in (visit(n, []) for n in sorted(graph)) if c), None)


def test_parts_import_only_downward() -> None:
    cycle = find_cycle(part_graph())
    assert cycle is None, "import cycle between parts: " + " -> ".join(cycle or [])


def test_modules_have_no_import_cycle() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle or [])


def test_the_readme_layers_are_the_imports() -> None:
    """README's list of layers, bottom first: every part is listed (``mtp_train.tools`` stands beside them) and
    imports only parts on lines above its own."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("**Imports go one way: down.**", 1)[1].split("```", 2)[1]
    level = {name: i for i, line in enumerate(block.splitlines())
             for name in re.split(r",\s*", line.split("(")[0].strip()) if name}
    graph = part_graph()
    assert set(graph) - {"mtp_train", "mtp_train.tools"} <= set(level), "parts missing from README's layers"
    upward = [f"{a} -> {b}" for a, targets in graph.items() if a in level for b in targets if level[b] >= level[a]]
    assert not upward, f"imports that README's layers do not allow: {upward}"


def test_no_base_or_training_module_imports_a_stage() -> None:
    """Only orchestration (cli, pipeline, slurm, export, memory) imports precompute or eval."""
    lower = tuple(f"mtp_train.{name}" for name in (*BASE, "train"))
    found = [f"{module} -> {target}" for module, targets in module_graph().items() if part(module) in lower
             for target in targets if part(target) in STAGES]
    assert not found, f"a base or training module imports a stage: {found}"
    assert {part(m) for m in module_graph()} >= set(lower) | set(STAGES), "a part named here no longer exists"


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    lazy = tmp_path / "run.py"
    lazy.write_text("def f():\n    from mtp_train.eval.report import Report\n")
    assert _imported("mtp_train.precompute.run", lazy, {"mtp_train.eval.report"}) == {"mtp_train.eval.report"}
    assert _module(ROOT / "eval" / "run.py") == "mtp_train.eval.run"


def long_functions(path: Path) -> dict[str, int]:
    """``name: lines`` of each function in ``path`` longer than the limit (nested functions count within theirs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name: n for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES}


def test_no_product_function_over_80_lines(tmp_path: Path) -> None:
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in _sources().values() for name, n in long_functions(p).items()}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"
    sample = tmp_path / "long.py"
    sample.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(sample) == {"f": MAX_FUNCTION_LINES + 1}


def test_no_python_file_over_400_lines() -> None:
    folders = (*PACKAGES, "bench", "tests", "data")
    long = {str(p.relative_to(ROOT)): n for f in folders for p in sorted((ROOT / f).rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"
