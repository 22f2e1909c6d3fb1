"""Row formats: detect them and turn every row into chat messages (or plain text).

- ``sharegpt``: ``conversations: [{from: human|gpt|system, value}]``
- ``openai``: ``messages: [{role: user|assistant|system, content}]``
- ``prompt_completion``: ``prompt`` and ``completion`` strings (one user turn, one assistant turn)
- ``text``: a ``text`` string, trained on every token
"""

from __future__ import annotations

from typing import Any

FORMATS = ("sharegpt", "openai", "prompt_completion", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")

Messages = list[dict[str, str]]


class BadRow(ValueError):
    """A row that does not fit its dataset's format."""


def detect_format(columns: list[str]) -> str | None:
    """The format a dataset's columns announce, or None."""
    if "conversations" in columns:
        return "sharegpt"
    if "messages" in columns:
        return "openai"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    return None


def _turns(items: Any, role_key: str, text_key: str, roles: dict[str, str]) -> Messages:
    if not isinstance(items, list) or not items:
        raise BadRow("expected a non-empty list of turns")
    out = []
    for turn in items:
        if not isinstance(turn, dict):
            raise BadRow("a turn is not a mapping")
        role, text = turn.get(role_key), turn.get(text_key)
        if role not in roles or not isinstance(text, str):
            raise BadRow(f"a turn has role {role!r} or a non-string {text_key!r}")
        out.append({"role": roles[role], "content": text})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("no assistant turn")
    return out


def to_messages(row: dict[str, Any], fmt: str) -> Messages | str:
    """Chat messages for a chat row, or the string for a ``text`` row. Raises ``BadRow``."""
    if fmt == "sharegpt":
        return _turns(row.get("conversations"), "from", "value", SHAREGPT_ROLES)
    if fmt == "openai":
        return _turns(row.get("messages"), "role", "content", {r: r for r in ROLES})
    if fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise BadRow("'prompt' and 'completion' must be strings, the completion non-empty")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if fmt == "text":
        text = row.get("text")
        if not isinstance(text, str) or not text:
            raise BadRow("'text' must be a non-empty string")
        return text
    raise ValueError(fmt)
