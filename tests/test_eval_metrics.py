"""Eval metrics on hand-computed examples, and the eval prompt sets."""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import REPO, TINY_TARGET
from mtp_train.eval.metrics import (
    RequestTrace,
    alpha,
    distinct2,
    expected_speedup,
    group_by,
    length_bucket,
    pooled_tau,
)
from mtp_train.eval.prompts import PROMPT_SETS, EvalPrompt, heldout_context, heldout_cuts, load_prompt_set, render_prompt
from mtp_train.errors import UserError
from mtp_train.recipe import PROMPT_SETS as RECIPE_PROMPT_SETS


def trace(accepted, emitted, *, pid="p", cat="c", prompt_tokens=10, output=None):
    return RequestTrace(pid, cat, prompt_tokens, list(accepted), list(emitted), list(output or []))


# Two requests, k = 3:
#   A: accepted [3, 1, 0], emitted [4, 2, 1]
#   B: accepted [2, 3],    emitted [3, 2]   (stopped at EOS after 2 of 4 tokens in its last step)
A = trace([3, 1, 0], [4, 2, 1], pid="a", cat="qa", prompt_tokens=100)
B = trace([2, 3], [3, 2], pid="b", cat="code", prompt_tokens=600)


def test_pooled_tau_pools_steps_over_requests():
    # (4 + 2 + 1 + 3 + 2) / 5 steps = 12 / 5; the mean of per-request ratios would be (7/3 + 5/2) / 2 = 2.4167.
    assert pooled_tau([A, B]) == pytest.approx(12 / 5)
    assert pooled_tau([A]) == pytest.approx(7 / 3)
    assert pooled_tau([]) == 0.0


def test_plain_decoding_has_tau_one_and_zero_alpha():
    plain = trace([0] * 6, [1] * 6)
    assert pooled_tau([plain]) == 1.0
    assert alpha([plain], 2) == ([0.0, 0.0], [0.0, 0.0])


def test_alpha_conditional_and_unconditional():
    # accepted over all 5 steps: 3, 1, 0, 2, 3
    # >=0: 5, >=1: 4, >=2: 3, >=3: 2
    cond, uncond = alpha([A, B], 3)
    assert cond == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert uncond == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    # The product of the conditional rates is the unconditional rate.
    assert cond[0] * cond[1] * cond[2] == pytest.approx(uncond[2])


def test_alpha_zero_denominators_and_bad_k():
    none_accepted = trace([0, 0], [1, 1])
    cond, uncond = alpha([none_accepted], 3)
    assert cond == [0.0, 0.0, 0.0] and uncond == [0.0, 0.0, 0.0]
    assert alpha([], 2) == ([0.0, 0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="more than k"):
        alpha([A], 2)  # A accepted 3 in a step


def test_trace_checks_its_counts():
    with pytest.raises(ValueError, match="emitted"):
        trace([1, 2], [2])
    with pytest.raises(ValueError, match="step 1"):
        trace([1, 0], [2, 2])  # emitted more than accepted + 1
    with pytest.raises(ValueError, match="step 0"):
        trace([1], [0])
    assert trace([2], [1]).steps == 1  # stopped at EOS on the first accepted token


def test_distinct2():
    # [1,2,1,2]: bigrams (1,2),(2,1),(1,2); [1,2,3]: (1,2),(2,3); [5]: none.
    # distinct {(1,2),(2,1),(2,3)} = 3 of 5.
    assert distinct2([[1, 2, 1, 2], [1, 2, 3], [5]]) == pytest.approx(3 / 5)
    # No bigram spans two outputs: [1] + [2] would make (1,2) otherwise.
    assert distinct2([[1], [2]]) == 0.0
    assert distinct2([]) == 0.0
    assert distinct2([[7, 7, 7, 7, 7]]) == pytest.approx(1 / 4)
    assert distinct2([[1, 2, 3, 4]]) == 1.0


@pytest.mark.parametrize(
    "n, bucket",
    [(0, "0-127"), (127, "0-127"), (128, "128-511"), (511, "128-511"), (512, "512-1023"), (1023, "512-1023"),
     (1024, "1024-2047"), (2047, "1024-2047"), (2048, "2048-4095"), (4096, "4096-8191"), (8191, "4096-8191"),
     (8192, "8192+"), (100_000, "8192+")],
)
def test_length_bucket_edges(n, bucket):
    assert length_bucket(n) == bucket


def test_length_bucket_rejects_negative():
    with pytest.raises(ValueError):
        length_bucket(-1)


def test_group_by_category_length_and_function():
    C = trace([1], [2], pid="c", cat="qa", prompt_tokens=3000)
    D = trace([0], [1], pid="d", cat="qa", prompt_tokens=5)
    by_cat = group_by([A, B, C, D], "category")
    assert list(by_cat) == ["code", "qa"]
    assert [t.prompt_id for t in by_cat["qa"]] == ["a", "c", "d"]
    by_len = group_by([C, B, A, D], "length_bucket")
    assert list(by_len) == ["0-127", "512-1023", "2048-4095"]  # length order, not string order
    assert [t.prompt_id for t in by_len["0-127"]] == ["a", "d"]
    assert pooled_tau(by_len["0-127"]) == pytest.approx((7 + 1) / 4)
    by_fn = group_by([A, B, C], lambda t: "long" if t.prompt_tokens > 500 else "short")
    assert {k: [t.prompt_id for t in v] for k, v in by_fn.items()} == {"long": ["b", "c"], "short": ["a"]}
    with pytest.raises(ValueError, match="unknown group key"):
        group_by([A], "colour")


def test_expected_speedup():
    assert expected_speedup(3.0, 4, 0.05) == pytest.approx(3.0 / 1.2)
    assert expected_speedup(2.4, 3, 0.0) == pytest.approx(2.4)
    assert expected_speedup(1.0, 1, 1.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        expected_speedup(2.0, 2, -0.1)


# --- prompt sets ----------------------------------------------------------------------------------------


def test_prompt_set_names_match_the_recipe():
    assert PROMPT_SETS == RECIPE_PROMPT_SETS


@pytest.mark.parametrize(
    "name, count, categories",
    [("spec_bench", 480, 13), ("mt_bench", 80, 8), ("humaneval", 164, 1), ("gsm8k", 1319, 1), ("long", 64, 4)],
)
def test_benchmark_sets_load_whole(name, count, categories):
    prompts = load_prompt_set(name)
    assert len(prompts) == count
    assert len({p.category for p in prompts}) == categories
    assert len({p.prompt_id for p in prompts}) == count  # ids are unique
    for p in prompts:
        assert p.set_name == name and p.prompt_id.startswith(name + "/")
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
        assert len(p.messages) == 1  # first turn only


def test_benchmark_prompts_hold_the_file_content():
    spec = {p.prompt_id: p for p in load_prompt_set("spec_bench")}
    first = json.loads((REPO / "data/eval/spec_bench/question.jsonl").read_text().splitlines()[0])
    p = spec[f"spec_bench/{first['question_id']}"]
    assert p.messages == [{"role": "user", "content": first["turns"][0]}] and p.category == first["category"]
    with gzip.open(REPO / "data/eval/humaneval/HumanEval.jsonl.gz", "rt") as f:
        he = json.loads(f.readline())
    p = load_prompt_set("humaneval")[0]
    assert p.prompt_id == "humaneval/0" and p.category == "code" and he["prompt"] in p.messages[0]["content"]
    g = load_prompt_set("gsm8k")[1]
    assert g.prompt_id == "gsm8k/1" and g.category == "math" and g.messages[0]["content"].startswith("A robe takes")


def test_long_prompts_are_held_out_from_training_and_reach_8k_tokens():
    def rows(path):
        with gzip.open(REPO / path, "rt") as f:
            return [json.loads(line) for line in f]

    evals, train, shipped = rows("data/long/eval.jsonl.gz"), rows("data/long/train.jsonl.gz"), rows(
        "data/general/prompts.jsonl.gz")
    used = {r["source_id"] for r in shipped}  # every Dolly recipe trains on these
    eval_ids = {i for r in evals for i in r["passages"]}
    train_ids = {i for r in train for i in r["passages"]}
    assert not eval_ids & used and not train_ids & used and not eval_ids & train_ids
    prompts = load_prompt_set("long")
    for p, r in zip(prompts, evals):
        assert p.messages == r["messages"] and p.category == r["category"]
        gold = int(p.messages[0]["content"].rsplit("Question about passage ", 1)[1].split(":")[0])
        assert r["passages"][gold - 1] == r["source_id"]  # the question is about the passage it names
    assert {length_bucket(r["prompt_tokens"]) for r in evals} == {"512-1023", "1024-2047", "2048-4095", "4096-8191"}
    assert max(r["prompt_tokens"] for r in evals + train) <= 8000  # SmolLM2 takes 8,192 positions
    assert all(r["messages"][-1]["role"] == "assistant" for r in train)


def test_sgd_dev_prompts_are_dev_dialogues_cut_like_heldout_rows():
    with gzip.open(REPO / "data/sgd/sgd_dev_sharegpt.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    prompts = load_prompt_set("sgd_dev")
    assert len(prompts) == len(rows) == 2098
    assert len({p.category for p in prompts}) == 16 and "Restaurants" in {p.category for p in prompts}
    for p in prompts[::97]:
        i = int(p.prompt_id.split("/")[1])
        turns = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                 for t in rows[i]["conversations"]]
        # a prefix of the dialogue that ends on a user turn an answer follows, with the row's own seed
        assert p.messages == heldout_context(turns, f"sgd_dev/{i}") == turns[: len(p.messages)]
        assert p.messages[-1]["role"] == "user" and turns[len(p.messages)]["role"] == "assistant"
        assert p.category == rows[i]["services"][0].split("_")[0]
    # no dev dialogue is also a training dialogue (ids restart per split; compare the turns)
    with gzip.open(REPO / "data/sgd/sgd_train_sharegpt.jsonl.gz", "rt") as f:
        train = {json.dumps(json.loads(line)["conversations"]) for line in f}
    assert not train & {json.dumps(r["conversations"]) for r in rows}


def test_stratified_subset_covers_every_category_and_is_deterministic():
    sub = load_prompt_set("spec_bench", max_prompts=20, seed=3)
    assert len(sub) == 20
    cats = sorted({p.category for p in load_prompt_set("spec_bench")})
    # Round-robin in sorted category order: the first 13 are one per category, in that order.
    assert [p.category for p in sub[:13]] == cats
    assert [p.category for p in sub[13:]] == cats[:7]
    assert sub == load_prompt_set("spec_bench", max_prompts=20, seed=3)
    assert [p.prompt_id for p in sub] != [p.prompt_id for p in load_prompt_set("spec_bench", max_prompts=20, seed=4)]
    # A smaller subset is a prefix of a larger one.
    assert load_prompt_set("spec_bench", max_prompts=7, seed=3) == sub[:7]
    # More than the set holds: all of it, once each.
    whole = load_prompt_set("mt_bench", max_prompts=1000)
    assert len(whole) == 80 and len({p.prompt_id for p in whole}) == 80


def test_unknown_set_and_missing_file_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"'squad'.*heldout, spec_bench, mt_bench, humaneval, gsm8k, sgd_dev"):
        load_prompt_set("squad")
    with pytest.raises(UserError, match=r"gsm8k.*test\.jsonl not found.*valid sets"):
        load_prompt_set("gsm8k", data_dir=tmp_path)
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text('{"question_id": 1, "turns": ["hi"]}\n{not json\n')
    with pytest.raises(UserError, match="cannot be read"):
        load_prompt_set("mt_bench", data_dir=tmp_path)
    with pytest.raises(UserError, match="heldout"):
        load_prompt_set("heldout")


CHAT = [
    {"from": "human", "value": "u1"}, {"from": "gpt", "value": "a1"},
    {"from": "human", "value": "u2"}, {"from": "gpt", "value": "a2"},
    {"from": "human", "value": "u3"}, {"from": "gpt", "value": "a3"},
]


def test_heldout_cuts():
    msgs = [{"role": r, "content": r} for r in ("system", "user", "assistant", "user", "user", "assistant", "assistant")]
    assert heldout_cuts(msgs) == [1, 4]
    assert heldout_cuts([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]) == []


def test_heldout_prompts_from_raw_rows():
    rows = [{"conversations": CHAT}, {"text": "plain"}, {"messages": [{"role": "user", "content": "q"},
                                                                       {"role": "assistant", "content": "r"}]}]
    prompts = load_prompt_set("heldout", heldout_rows=rows, heldout_ids=[0, 1, 2])
    # the text row (1) has no prompt
    assert [p.prompt_id for p in prompts] == ["heldout/row-0", "heldout/row-2"]
    p0 = prompts[0]
    assert p0.set_name == "heldout" and p0.category == "heldout"
    assert p0.messages[-1]["role"] == "user" and p0.messages[-1]["content"] in {"u1", "u2", "u3"}
    n = len(p0.messages)
    assert p0.messages == [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                           for i, c in enumerate(["u1", "a1", "u2", "a2", "u3"][:n])]
    assert prompts[1].messages == [{"role": "user", "content": "q"}]
    # The turn picked for a row depends on its id only, not on the seed or on which other rows are asked for.
    again = load_prompt_set("heldout", heldout_rows=rows, heldout_ids=[0], seed=99)
    assert again[0] == p0
    with pytest.raises(UserError, match="not in the data"):
        load_prompt_set("heldout", heldout_rows=rows, heldout_ids=[0, 7])
    with pytest.raises(UserError, match="plain-text"):
        load_prompt_set("heldout", heldout_rows=rows, heldout_ids=[1])


def test_heldout_picks_spread_over_turns():
    rows = [{"conversations": CHAT}] * 60
    picks = {len(p.messages) for p in load_prompt_set("heldout", heldout_rows=rows)}
    assert picks == {1, 3, 5}  # every user turn is picked for some row


def test_heldout_rows_from_precompute_render_as_a_prefix_of_the_training_tokens():
    from transformers import AutoTokenizer

    from mtp_train.data.dataset import encode, load_rows

    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    data = load_rows([REPO / "data/sgd/sgd_dev_sharegpt.jsonl.gz"], "auto", False, 40)
    ids = [3, 17, 25, 38]
    prompts = load_prompt_set("heldout", heldout_rows=data.rows, heldout_ids=ids)
    assert [p.prompt_id for p in prompts] == [f"heldout/row-{i}" for i in ids]
    by_id = {r.row_id: r for r in data.rows}
    for row_id, p in zip(ids, prompts):
        rendered = render_prompt(tok, p.messages)
        full, mask, _ = encode(tok, by_id[row_id].content, 10**6)
        assert full[: len(rendered)] == rendered  # same BOS, same template
        assert rendered[0] == tok.bos_token_id and rendered.count(tok.bos_token_id) == 1
        assert tok.decode(rendered[-1:]) == "<|assistant|>"  # the generation prompt
        assert mask[len(rendered)] == 1 and mask[len(rendered) - 1] == 0  # the reply is what training learned
    sub = load_prompt_set("heldout", heldout_rows=data.rows, heldout_ids=ids, max_prompts=2, seed=1)
    assert len(sub) == 2 and all(p in prompts for p in sub)


def test_render_prompt_rejects_a_tokenizer_without_template():
    class NoTemplate:
        chat_template = None
        name_or_path = "fake"

    with pytest.raises(UserError, match="no chat template"):
        render_prompt(NoTemplate(), [{"role": "user", "content": "x"}])


def test_eval_prompt_is_frozen():
    p = EvalPrompt("gsm8k", "gsm8k/0", "math", [{"role": "user", "content": "x"}])
    with pytest.raises(AttributeError):
        p.category = "other"  # type: ignore[misc]


def test_prompt_set_groups_pool_back_to_the_whole():
    from mtp_train.eval.metrics import LosslessVerdict, PointTiming, sweep_point

    traces = [trace([1, 0, 1], [2, 1, 2], pid="spec_bench/1", cat="coding"),
              trace([0, 0], [1, 1], pid="mt_bench/2", cat="writing"),
              trace([1, 1, 1, 0], [2, 2, 2, 1], pid="mt_bench/3", cat="math")]
    point = sweep_point(1, 0.0, traces, PointTiming(c=0.1, measured_speedup=1.0), LosslessVerdict(lossless=True))
    groups = point.by_prompt_set
    assert {n: g.num_steps for n, g in groups.items()} == {"spec_bench": 3, "mt_bench": 6}
    pooled = sum(g.alpha[0] * g.num_steps for g in groups.values()) / sum(g.num_steps for g in groups.values())
    assert pooled == pytest.approx(5 / 9, abs=1e-4) and point.alpha[0] == pytest.approx(5 / 9, abs=1e-4)
