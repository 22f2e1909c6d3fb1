"""Print the recipe reference (every field, its type, default and meaning) as Markdown.

It is rendered from the schema's JSON schema. The "Recipe reference" section of ``docs/recipes.md`` (between the
``recipe-reference`` markers) is this output, and ``tests/test_readme.py`` keeps the two equal::

    .venv/bin/python -m mtp_train.tools.recipe_reference
"""

from __future__ import annotations

import json
from typing import Any

from mtp_train.recipe import Recipe

_BOUNDS = (("exclusiveMinimum", ">"), ("minimum", "≥"), ("exclusiveMaximum", "<"), ("maximum", "≤"))
_TYPES = {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "null": "null"}


def _type_text(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type_text(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "$ref" in prop:
        return "mapping (below)"
    if prop.get("type") == "array":
        text = f"list of {_type_text(prop['items'])}"
        return text + (f", at least {prop['minItems']}" if "minItems" in prop else "")
    if prop.get("format") == "path":
        return "path"
    text = _TYPES.get(prop.get("type", ""), prop.get("type", "any"))
    bounds = [f"{sign} {prop[key]}" for key, sign in _BOUNDS if key in prop]
    return f"{text} {', '.join(bounds)}" if bounds else text


def reference_markdown() -> str:
    schema = Recipe.model_json_schema()
    defs = schema.get("$defs", {})
    out: list[str] = []
    queue: list[tuple[str, dict[str, Any]]] = [("", schema)]
    while queue:
        prefix, model = queue.pop(0)
        rows, nested = [], []
        required = set(model.get("required", []))
        for name, prop in model["properties"].items():
            path = f"{prefix}.{name}" if prefix else name
            ref = prop.get("$ref")
            if ref:
                nested.append((path, defs[ref.rsplit("/", 1)[-1]]))
                continue
            item = prop.get("items", {}).get("$ref")
            if item:  # a list of sections (eval.trees): their fields get a table of their own
                nested.append((f"{path}[]", defs[item.rsplit("/", 1)[-1]]))
            default = "required" if name in required else f"`{json.dumps(prop.get('default'))}`"
            meaning = prop.get("description", "").replace("|", "\\|")
            rows.append(f"| `{path}` | {_type_text(prop)} | {default} | {meaning} |")
        title = f"`{prefix}`" if prefix else "top level"
        out += [f"#### {title}", "", model.get("description", "").strip(), ""]
        out += ["| field | type | default | meaning |", "|---|---|---|---|", *rows, ""]
        queue = nested + queue
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
