"""Optional regeneration: replace the dataset's assistant turns with the target's own answers, resumably.

Every row's first assistant turn is queued on one continuous-batching scheduler of the runtime, which runs as
many requests at once as its sequence limit and KV pages allow (preempting under page pressure); when a row's
turn j is answered, its turn j+1 is queued with the regenerated turn j in its context, as in a real chat.
Text rows are left as they are. Each (row, turn) has its own sampling seed, so the draw does not depend on
which rows share a batch or a rank.

The answers are kept and reused as ``mtp_train.data.answers`` describes.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import torch

from mtp_train.progress import Progress
from mtp_train.recipe import SamplingConfig
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.sequence import Status
from mtp_train.data.answers import SAVE_ROWS, SAVE_SECONDS, AnswerFile
from mtp_train.data.dataset import Row
from mtp_train.io import crash_point


def _prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def regenerate(rows: list[Row], tokenizer: Any, engine: Engine, sampling: SamplingConfig,
               max_length: int | None = None, file: AnswerFile | None = None, every: float | None = None) -> list[Row]:
    """``rows`` with every chat's assistant turns replaced by the target's answers.

    A conversation whose next turn's prompt already holds ``max_length`` tokens (precompute would truncate
    that turn away) ends after its last regenerated answer, so nothing is generated only to be cut off.

    With ``file``, answers are kept there and reused (``AnswerFile``). Progress (rows, answers, tokens, tokens/s,
    ETA in rows) is shown on a terminal or printed every ``every`` seconds (``mtp_train.progress``).
    Under tensor parallelism every rank reads the file and generates alike, and only the leader writes and prints
    (``AnswerFile.write``).
    """
    write = file is None or file.write
    save_rows, save_seconds = (file.save_rows, file.save_seconds) if file is not None else (SAVE_ROWS, SAVE_SECONDS)
    done = file.read() if file is not None else {}
    chats = [Row(r.row_id, [dict(m) for m in r.content]) for r in rows
             if not isinstance(r.content, str) and r.row_id not in done]
    total = len(done) + len(chats)
    if file is not None and done and write:
        print(f"regenerate: {file.path.name} already holds {len(done)} of {total} rows; continuing", file=sys.stderr)
    stop = set(engine.stop_ids)
    turns = {r.row_id: [i for i, m in enumerate(r.content) if m["role"] == "assistant"] for r in chats}
    scheduler, _ = engine.start([], [])
    pending: dict[int, tuple[Row, int]] = {}  # request id -> (row, its j-th assistant turn)
    request_ids = itertools.count()

    def submit(r: Row, j: int) -> bool:
        prompt = _prompt(tokenizer, r.content[: turns[r.row_id][j]])
        if j and max_length is not None and len(prompt) >= max_length:
            del r.content[turns[r.row_id][j - 1] + 1 :]
            return False
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_new_tokens,
                                sampling.seed * 1_000_003 + r.row_id * 101 + j)
        request = next(request_ids)
        pending[request] = (r, j)
        engine.submit(scheduler, request, prompt, params)
        return True

    finished: list[Row] = []
    saves = answers = 0
    progress = Progress("regenerate", total, "rows", initial=len(done), enabled=write and bool(chats), every=every)

    last_save = time.monotonic()

    def save() -> None:
        nonlocal finished, saves, last_save
        last_save = time.monotonic()
        if file is not None and write and finished:
            file.append(finished)
            crash_point("regenerate", saves)
            saves += 1
        done.update((r.row_id, r.content) for r in finished)
        finished = []

    with torch.inference_mode():
        for r in chats:
            if turns[r.row_id]:
                submit(r, 0)
            else:
                finished.append(r)
        while not scheduler.done:
            scheduled, _, _ = engine.step(scheduler)
            tokens = 0
            for seq, _ in scheduled:
                if seq.status is not Status.FINISHED:
                    continue
                r, j = pending.pop(seq.request_id)
                tokens, answers = tokens + len(seq.output), answers + 1
                answer = [t for t in seq.output if t not in stop]
                r.content[turns[r.row_id][j]]["content"] = tokenizer.decode(answer, skip_special_tokens=True)
                # the next turn sees this answer, as in a real chat
                if j + 1 == len(turns[r.row_id]) or not submit(r, j + 1):
                    finished.append(r)
            rows_done = len(done) + len(finished)
            if len(finished) >= save_rows or (finished and time.monotonic() - last_save >= save_seconds):
                save()
            progress.update(rows_done - progress.done, tokens, note=f"{answers:,} answers")
        save()
    progress.close()
    return [Row(r.row_id, done[r.row_id]) if r.row_id in done else r for r in rows]
