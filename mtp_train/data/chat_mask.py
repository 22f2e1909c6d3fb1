"""Assistant loss masks for any chat template.

Templates with ``{% generation %}`` markers use transformers' ``return_assistant_tokens_mask``.

Templates without them use the *skeleton* method, which needs no prefix-preserving template:

1. Render the conversation with every assistant content replaced by a placeholder (``MTPSPAN0Q``,
   ``MTPSPAN1Q``, ...). Splitting that render at the placeholders gives the template's own text,
   ``seg_0 P_0 seg_1 P_1 ... seg_n``.
2. Render the real conversation. It must start with ``seg_0`` and end with ``seg_n``, and every
   ``seg_i`` in between is found after the previous content; the text between two segments is the
   template's rendering of that assistant content (perhaps trimmed or with its reasoning dropped).
3. A turn's span is that text plus its end-of-turn marker: the special token that starts the next
   segment, when it is the same token the template puts right after the final assistant turn
   (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ...). A role header is never taken.
4. Tokens of the real render whose character range overlaps a span are masked, so a leading space
   glued to the first word (Mistral's ``" " + content``) is included.
"""

from __future__ import annotations

import re
from typing import Any

from mtp_train.errors import UserError
from mtp_train.data.formats import Messages

GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
FIX_HINT = "set data.chat_template to a .jinja template that fits this data"

Encoded = tuple[list[int], list[int]]  # token ids, loss mask


def has_generation_markers(template: Any) -> bool:
    """Whether ``template`` is a chat template string with ``{% generation %}`` markers."""
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def require_template(tokenizer: Any, source: str) -> None:
    """Refuse a tokenizer without a chat template (chat rows cannot be rendered then)."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise UserError(f"{source}: the tokenizer has no chat template but the data has chat rows; "
                        "set data.chat_template to a .jinja template")


def chat_masks(
    tokenizer: Any, conversations: list[Messages], row_ids: list[int], chunk: int = 256
) -> list[Encoded]:
    """Token ids and assistant loss mask (1 on assistant tokens) of every conversation.

    ``row_ids`` name the rows in error messages. Raises ``UserError`` when the template fails on a
    row or when a row's assistant turns cannot be located in its render.
    """
    require_template(tokenizer, "tokenizer")
    marked = has_generation_markers(tokenizer.chat_template)
    out: list[Encoded] = []
    for start in range(0, len(conversations), chunk):
        convs, ids = conversations[start : start + chunk], row_ids[start : start + chunk]
        out += _marked_masks(tokenizer, convs, ids) if marked else _skeleton_masks(tokenizer, convs, ids)
    return out


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _template_error(tokenizer: Any, convs: list[Messages], row_ids: list[int], error: Exception) -> UserError:
    """The ``UserError`` naming the first row the template fails on (``error`` came from the whole batch)."""
    for conv, rid in zip(convs, row_ids):
        try:
            tokenizer.apply_chat_template(conv, tokenize=False)
        except Exception as e:  # templates raise TemplateError, TypeError, ... on rows they reject
            return UserError(f"row {rid}: the chat template fails on it: {_one_line(e)}; fix the row or {FIX_HINT}")
    return UserError(f"rows {row_ids[0]}..{row_ids[-1]}: the chat template fails: {_one_line(error)}; {FIX_HINT}")


def _render(tokenizer: Any, convs: list[Messages], row_ids: list[int]) -> list[str]:
    """Every conversation rendered as text, in one call; a failure is pinned on its row."""
    try:
        return list(tokenizer.apply_chat_template(convs, tokenize=False))
    except Exception as e:  # any template failure becomes a one-line error naming the row
        raise _template_error(tokenizer, convs, row_ids, e) from None


def _marked_masks(tokenizer: Any, convs: list[Messages], row_ids: list[int]) -> list[Encoded]:
    """Masks from the template's own ``{% generation %}`` spans."""
    try:
        enc = tokenizer.apply_chat_template(convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    except Exception as e:  # any template failure becomes a one-line error naming the row
        raise _template_error(tokenizer, convs, row_ids, e) from None
    return [(list(ids), list(mask)) for ids, mask in zip(enc["input_ids"], enc["assistant_masks"])]


def _stem(conv: Messages) -> str:
    """A placeholder stem that occurs in no message of ``conv``."""
    stem = "MTPSPAN"
    while any(stem in str(m.get("content", "")) for m in conv):
        stem += "X"
    return stem


def _skeleton(conv: Messages, stem: str) -> Messages:
    """``conv`` with assistant content ``i`` replaced by ``{stem}{i}Q``."""
    out, n = [], 0
    for m in conv:
        if m.get("role") == "assistant":
            m = {**m, "content": f"{stem}{n}Q"}
            n += 1
        out.append(m)
    return out


def _segments(skeleton_text: str, stem: str, turns: int) -> list[str] | None:
    """The template text around the placeholders, or None unless each occurs once and in order."""
    segs, pos = [], 0
    for i in range(turns):
        mark = f"{stem}{i}Q"
        at = skeleton_text.find(mark, pos)
        if at < 0 or skeleton_text.count(mark) != 1:
            return None
        segs.append(skeleton_text[pos:at])
        pos = at + len(mark)
    segs.append(skeleton_text[pos:])
    return segs


def _align(text: str, segs: list[str]) -> list[tuple[int, int]] | None:
    """Character span of each assistant content in ``text``, or None if ``segs`` do not fit it."""
    if len(segs) == 1:
        return [] if text == segs[0] else None
    if not text.startswith(segs[0]) or not text.endswith(segs[-1]):
        return None
    spans, pos = [], len(segs[0])
    for seg in segs[1:-1]:
        at = text.find(seg, pos)
        if at < 0:
            return None
        spans.append((pos, at))
        pos = at + len(seg)
    end = len(text) - len(segs[-1])
    if end < pos:
        return None
    return spans + [(pos, end)]


def _leading_token(text: str, specials: list[str]) -> str:
    """The special token ``text`` starts with ('' if none); ``specials`` go longest first."""
    return next((s for s in specials if text.startswith(s)), "")


def _tail_marker(tokenizer: Any, conv: Messages, segs: list[str], stem: str, specials: list[str]) -> str:
    """The end-of-turn token: the special token right after the final assistant turn's placeholder."""
    last = max((i for i, m in enumerate(conv) if m.get("role") == "assistant"), default=None)
    if last is None:
        return ""
    if last == len(conv) - 1:
        return _leading_token(segs[-1], specials)
    try:  # the conversation goes on after its last assistant turn: render it cut there
        cut = tokenizer.apply_chat_template(_skeleton(conv[: last + 1], stem), tokenize=False)
    except Exception:  # no cut render, no end marker
        return ""
    turns = sum(m.get("role") == "assistant" for m in conv)
    mark = f"{stem}{turns - 1}Q"
    return _leading_token(cut[cut.find(mark) + len(mark) :], specials) if mark in cut else ""


def _specials(tokenizer: Any) -> list[str]:
    """Special and added token strings of ``tokenizer``, longest first."""
    added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return sorted(added | set(tokenizer.all_special_tokens), key=len, reverse=True)


def _char_spans(
    tokenizer: Any, conv: Messages, stem: str, text: str, skeleton_text: str, specials: list[str], rid: int
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns (content plus end-of-turn token) in ``text``."""
    turns = sum(m.get("role") == "assistant" for m in conv)
    segs = _segments(skeleton_text, stem, turns)
    spans = _align(text, segs) if segs is not None else None
    if segs is None or spans is None:
        raise UserError(
            f"row {rid}: cannot locate the assistant turns in the chat template's rendering "
            f"(the template rewrites assistant text in a way the mask cannot follow); {FIX_HINT}"
        )
    marker = _tail_marker(tokenizer, conv, segs, stem, specials)
    out = []
    for (start, end), seg in zip(spans, segs[1:]):
        if marker and seg.startswith(marker):
            end += len(marker)
        out.append((start, end))
    return out


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 on every token whose character range overlaps a span (both lists in order)."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and end > start:
            mask[t] = 1
    return mask


def _skeleton_masks(tokenizer: Any, convs: list[Messages], row_ids: list[int]) -> list[Encoded]:
    """Masks by the skeleton method (module docstring) for templates without generation markers."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{type(tokenizer).__name__}: a fast tokenizer is needed to mask chat templates without "
                        "{% generation %} markers; use a tokenizer.json tokenizer or a template with markers")
    texts = _render(tokenizer, convs, row_ids)
    stems = [_stem(c) for c in convs]
    skeletons = _render(tokenizer, [_skeleton(c, stem) for c, stem in zip(convs, stems)], row_ids)
    specials = _specials(tokenizer)
    spans = [_char_spans(tokenizer, c, stem, t, s, specials, r)
             for c, stem, t, s, r in zip(convs, stems, texts, skeletons, row_ids)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    check = tokenizer.apply_chat_template(convs[0], tokenize=True, return_dict=True)["input_ids"]
    if list(check) != list(enc["input_ids"][0]):
        raise RuntimeError(f"row {row_ids[0]}: tokenizing the rendered chat differs from apply_chat_template")
    return [
        (list(ids), _token_mask(list(offsets), sp))
        for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans)
    ]
