"""Optional regeneration: replace the dataset's assistant turns with the target's own answers, resumably.

Turn j of every conversation in a chunk is generated in one ``generate`` call through the runtime, which
batches as many requests as its KV pages allow (continuous batching, preempting under page pressure); turn
j+1 then sees the regenerated turn j, as it would in a real chat. Text rows are left as they are. Each
(row, turn) has its own seed, so an answer does not depend on the chunking, the batch or the rank.

The answers are kept as a dataset file, ``FEATURES/regenerated.rank-RRRRR.jsonl``: a header line
``{"fingerprint": ...}`` (target, tokenizer, chat template, data, sampling and seed), then one line per
regenerated row, ``{"row_id": N, "messages": [...]}`` (the ``openai`` row format), appended and fsync'd after
every chunk. A rerun keeps the rows the file already holds (a torn last line from a kill is cut off) and
generates only the rest; a file with another fingerprint is started afresh.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mtp_train.recipe import SamplingConfig
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from precompute.dataset import Row
from precompute.writer import crash_point


def regenerated_path(features: Path, rank: int) -> Path:
    return features / f"regenerated.rank-{rank:05d}.jsonl"


def _read_done(path: Path, fingerprint: str, write: bool) -> dict[int, list[dict[str, str]]]:
    """Rows the file already holds; a torn last line is cut off, a file of another fingerprint is removed (both
    only when ``write``)."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    lines = data.split(b"\n")
    good = len(data) if data.endswith(b"\n") else len(data) - len(lines[-1])
    done: dict[int, list[dict[str, str]]] = {}
    try:
        header = json.loads(lines[0]) if lines[0] else {}
    except json.JSONDecodeError:
        header = {}
    if header.get("fingerprint") != fingerprint:
        if write:
            path.unlink()
        return {}
    for line in lines[1:]:
        if line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # only the torn last line can be partial; good stops before it
                break
            done[int(rec["row_id"])] = rec["messages"]
    if good < len(data) and write:
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _append(path: Path, lines: list[str], header: str | None) -> None:
    with open(path, "a", encoding="utf-8") as f:
        if header is not None:
            f.write(header + "\n")
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _regenerate_chunk(chats: list[Row], tokenizer: Any, engine: Engine, sampling: SamplingConfig) -> int:
    """Regenerate ``chats`` in place, turn by turn; returns the number of generated tokens."""
    turns = {id(r): [i for i, m in enumerate(r.content) if m["role"] == "assistant"] for r in chats}
    stop, tokens = set(engine.stop_ids), 0
    for j in range(max((len(t) for t in turns.values()), default=0)):
        todo = [r for r in chats if len(turns[id(r)]) > j]
        prompts, params = [], []
        for r in todo:
            at = turns[id(r)][j]
            prompts.append(tokenizer.apply_chat_template(r.content[:at], add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"])
            seed = sampling.seed * 1_000_003 + r.row_id * 101 + j
            params.append(SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p,
                                         sampling.max_new_tokens, seed))
        for r, result in zip(todo, engine.generate(prompts, params)):
            tokens += len(result.tokens)
            answer = [t for t in result.tokens if t not in stop]
            r.content[turns[id(r)][j]]["content"] = tokenizer.decode(answer, skip_special_tokens=True)
    return tokens


def regenerate(rows: list[Row], tokenizer: Any, engine: Engine, sampling: SamplingConfig, path: Path | None = None,
               fingerprint: str = "", chunk: int | None = None, write: bool = True) -> list[Row]:
    """``rows`` with every chat's assistant turns replaced by the target's answers.

    With ``path``, answers are kept there and reused (module docstring); ``chunk`` rows are generated and
    saved at a time (default: the engine's ``max_seqs``, the most requests it runs at once). Under tensor
    parallelism every rank reads ``path`` and generates alike, and only the leader writes (``write``).
    """
    done = _read_done(path, fingerprint, write) if path is not None else {}
    chats = [Row(r.row_id, [dict(m) for m in r.content]) for r in rows
             if not isinstance(r.content, str) and r.row_id not in done]
    chunk = chunk or engine.max_seqs
    total, tokens, start = len(done) + len(chats), 0, time.perf_counter()
    if path is not None and done and write:
        print(f"regenerate: {path.name} already holds {len(done)} of {total} rows; continuing", file=sys.stderr)
    for c in range(0, len(chats), chunk):
        part = chats[c : c + chunk]
        tokens += _regenerate_chunk(part, tokenizer, engine, sampling)
        if path is not None and write:
            header = json.dumps({"fingerprint": fingerprint}) if not path.is_file() else None
            _append(path, [json.dumps({"row_id": r.row_id, "messages": r.content}) for r in part], header)
            crash_point("regenerate", c // chunk)
        for r in part:
            done[r.row_id] = r.content
        elapsed = time.perf_counter() - start
        if write:
            print(f"regenerate: {len(done)}/{total} rows, {tokens:,} tokens generated, {tokens / elapsed:,.0f} tok/s",
                  file=sys.stderr)
    return [Row(r.row_id, done[r.row_id]) if r.row_id in done else r for r in rows]
