"""Text samples for the report: a few prompts per prompt set with the reply the headline sweep point decoded."""

from __future__ import annotations

from typing import Any

from mtp_train.eval.prompts import EvalPrompt
from mtp_train.eval.report import Sample

PER_SET = 2
"""Prompts shown per prompt set."""
MAX_CHARS = 1200
"""Prompt text beyond this is cut (marked with an ellipsis); replies are short already (eval.max_new_tokens)."""


def _prompt_text(p: EvalPrompt) -> str:
    text = "\n\n".join(f"[{m['role']}] {m['content']}" for m in p.messages)
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def pick_samples(prompts: list[EvalPrompt], replies: list[list[int]], plain: list[list[int]], tokenizer: Any,
                 compared: bool, per_set: int = PER_SET) -> list[Sample]:
    """The first ``per_set`` prompts of each set, with ``replies`` (token ids, one per prompt) decoded.

    ``compared`` is whether the replies were checked against ``plain`` (the sweep point ran at T = 0).
    """
    out: list[Sample] = []
    shown: dict[str, int] = {}
    for p, reply, reference in zip(prompts, replies, plain, strict=True):
        if shown.get(p.set_name, 0) >= per_set:
            continue
        shown[p.set_name] = shown.get(p.set_name, 0) + 1
        out.append(Sample(prompt_set=p.set_name, category=p.category, prompt=_prompt_text(p),
                          reply=tokenizer.decode(reply, skip_special_tokens=True),
                          identical_to_plain=(reply == reference) if compared else None))
    return out
