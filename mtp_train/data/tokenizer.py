"""The recipe's tokenizer: the target's, with the chat template that ``data.chat_template`` may override."""

from __future__ import annotations

from typing import Any

from mtp_train.errors import UserError
from mtp_train.recipe import Recipe


def load_tokenizer(recipe: Recipe) -> Any:
    """The target's tokenizer; with ``data.chat_template`` set, that ``.jinja`` file replaces its chat template.

    Precompute, regeneration and the eval's prompts all load it here, so they render with the same template.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
    path = recipe.data.chat_template
    if path is not None:
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"data.chat_template: cannot read {path} ({e.__class__.__name__}); give a .jinja file") from None
    return tokenizer
