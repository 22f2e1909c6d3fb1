"""Regeneration keeps its answers in a fingerprinted JSONL file, and a killed run continues where it stopped."""

from __future__ import annotations

import json
import re

import pytest

from conftest import TINY_TARGET
from mtp_train.recipe import SamplingConfig
from mtp_train.data.dataset import Row
from mtp_train.precompute.regenerate import AnswerFile, regenerate
from precompute_helpers import sgd_rows


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoTokenizer

    from mtp_train.runtime.engine import Engine

    rows = [Row(i, [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]}
                    for m in r["conversations"][:4]]) for i, r in enumerate(sgd_rows(6))]
    return rows, AutoTokenizer.from_pretrained(TINY_TARGET), Engine.from_pretrained(TINY_TARGET)


SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3)


def test_a_killed_regeneration_resumes_without_losing_or_redoing_rows(parts, tmp_path, capsys):
    rows, tokenizer, engine = parts
    fresh = regenerate(rows, tokenizer, engine, SAMPLING)  # no file: the reference answers
    assert all(a.content != b.content for a, b in zip(fresh, rows)), "every row's answers are the target's"

    path = tmp_path / "regenerated.rank-00000.jsonl"
    regenerate(rows[:4], tokenizer, engine, SAMPLING, file=AnswerFile(path, "fp", save_rows=2))
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"fingerprint": "fp"} and len(lines) == 5
    # A kill in the middle of writing the second chunk: its last line is torn.
    torn = "\n".join(lines[:4]) + "\n" + lines[4][: len(lines[4]) // 2]
    path.write_text(torn)
    capsys.readouterr()
    calls = []
    submit = engine.submit
    engine.submit = lambda *args: calls.append(args[1]) or submit(*args)
    try:
        resumed = regenerate(rows, tokenizer, engine, SAMPLING, file=AnswerFile(path, "fp", save_rows=2))
    finally:
        del engine.submit
    err = capsys.readouterr().err
    assert "already holds 3 of 6 rows" in err
    assert re.search(r"^regenerate: 6/6 rows in \d+s, 6 answers, [\d,]+ tokens, [\d,]+ tok/s$", err, re.M), err
    assert len(calls) == 3 * 2, "only the 3 missing rows, 2 assistant turns each"
    assert [r.content for r in resumed] == [r.content for r in fresh]
    stored = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert sorted(s["row_id"] for s in stored) == list(range(6)), "each row exactly once"


def test_another_fingerprint_starts_afresh(parts, tmp_path):
    rows, tokenizer, engine = parts
    path = tmp_path / "regenerated.rank-00000.jsonl"
    regenerate(rows[:2], tokenizer, engine, SAMPLING, file=AnswerFile(path, "old"))
    again = regenerate(rows[:2], tokenizer, engine, SAMPLING.model_copy(update={"seed": 4}),
                       file=AnswerFile(path, "new"))
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"fingerprint": "new"} and len(lines) == 3
    assert [json.loads(x)["messages"] for x in lines[1:]] == [r.content for r in again]


def test_a_conversation_ends_where_precompute_would_truncate(parts):
    rows, tokenizer, engine = parts
    first = [tokenizer.apply_chat_template(r.content[:1], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"] for r in rows[:2]]
    short = regenerate(rows[:2], tokenizer, engine, SAMPLING, max_length=max(map(len, first)) + 1)
    full = regenerate(rows[:2], tokenizer, engine, SAMPLING)
    for cut, whole in zip(short, full):
        # the second answer's prompt (first turn, its answer, the next user turn) is over the limit: not generated
        assert [m["role"] for m in cut.content] == ["user", "assistant"]
        assert cut.content == whole.content[:2]


@pytest.mark.parametrize("seconds, appends", [(3600.0, 1), (0.0, None)])
def test_answers_are_appended_by_time_as_well_as_by_count(parts, tmp_path, monkeypatch, seconds, appends):
    """Rows that finish at different steps, a count never reached: with no time bound they are written once, at the
    end; with a bound of 0 s, as each step finishes some (so a kill among slow, long rows loses little)."""
    rows, tokenizer, engine = parts
    calls: list[int] = []
    append = AnswerFile.append
    monkeypatch.setattr(AnswerFile, "append", lambda self, done: calls.append(len(done)) or append(self, done))
    path = tmp_path / "regenerated.rank-00000.jsonl"
    regenerate(rows, tokenizer, engine, SAMPLING, file=AnswerFile(path, "fp", save_rows=1000, save_seconds=seconds))
    assert sum(calls) == len(rows) and len(path.read_text().splitlines()) == len(rows) + 1
    assert (len(calls) == appends) if appends else (len(calls) > 1), calls
