"""Optional regeneration: replace the dataset's assistant turns with the target's own answers.

Turn j of every conversation is generated in one batch through the runtime's ``generate``; turn
j+1 then sees the regenerated turn j, as it would in a real chat. Text rows are left as they are.
"""

from __future__ import annotations

from typing import Any

from mtp_train.recipe import SamplingConfig
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from precompute.dataset import Row


def regenerate(rows: list[Row], tokenizer: Any, engine: Engine, sampling: SamplingConfig) -> list[Row]:
    chats = [Row(r.row_id, [dict(m) for m in r.content]) for r in rows if not isinstance(r.content, str)]
    turns = {id(r): [i for i, m in enumerate(r.content) if m["role"] == "assistant"] for r in chats}
    stop = set(engine.stop_ids)
    for j in range(max((len(t) for t in turns.values()), default=0)):
        todo = [r for r in chats if len(turns[id(r)]) > j]
        prompts, params = [], []
        for r in todo:
            at = turns[id(r)][j]
            prompts.append(
                tokenizer.apply_chat_template(r.content[:at], add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
            # A seed per (row, turn): the same row gets the same answer in any batch and on any rank.
            seed = sampling.seed * 1_000_003 + r.row_id * 101 + j
            params.append(
                SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_new_tokens, seed)
            )
        for r, result in zip(todo, engine.generate(prompts, params)):
            answer = [t for t in result.tokens if t not in stop]
            r.content[turns[id(r)][j]]["content"] = tokenizer.decode(answer, skip_special_tokens=True)
    by_id = {r.row_id: r for r in chats}
    return [by_id.get(r.row_id, r) for r in rows]
