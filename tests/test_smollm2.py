"""The real pretrained target, SmolLM2-135M-Instruct (30 layers, vocab 49,152), against transformers and end to end.

The checkpoint is not in git: ``make smollm2`` fetches and converts it (``make test`` does it first). Without it
these tests skip and say so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_cli
from precompute_helpers import make_recipe, sgd_rows, write_jsonl

SMOLLM2 = REPO / ".cache" / "smollm2-135m-instruct"
needs_model = pytest.mark.skipif(not (SMOLLM2 / ".complete").is_file(),
                                 reason=f"{SMOLLM2} is absent: run `make smollm2` to fetch and convert it")
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Write a haiku about the sea.",
             "How many legs does a spider have?"]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtp_train.runtime.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    engine = Engine.from_pretrained(SMOLLM2, dtype=torch.float32, device=torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    return tokenizer, engine, hf, prompts


@needs_model
@pytest.mark.slow
def test_score_matches_transformers_on_the_real_weights(models):
    _, engine, hf, prompts = models
    out = engine.score(prompts, layers=[-1], topk=16)
    for i, seq in enumerate(prompts):
        a, b = out.cu_seqlens[i], out.cu_seqlens[i + 1]
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        values, ids = logprobs.topk(16, -1)
        assert (out.topk_logprobs[a:b] - values).abs().max() <= 1e-4
        assert (out.topk_ids[a:b, 0] == ids[:, 0]).all()
        assert (out.logsumexp[a:b] - torch.logsumexp(logits, -1)).abs().max() <= 1e-4
        # The mass outside the top-K, straight from the logits (1 - sum(top-K) loses it to rounding when it is small).
        rest = logprobs.double().scatter(-1, out.topk_ids[a:b], float("-inf")).logsumexp(-1)
        assert (out.tail_logprob[a:b].double() - rest).abs().max() <= 1e-3


@needs_model
@pytest.mark.slow
def test_greedy_generate_matches_transformers(models):
    from mtp_train.runtime.sampling import SamplingParams

    tokenizer, engine, hf, prompts = models
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(prompt):].tolist()
        assert result.tokens == ref
    assert tokenizer.decode(ours[0].tokens, skip_special_tokens=True) == "The capital of France is Paris."


@needs_model
@pytest.mark.slow
def test_stock_template_precompute_train_eval(tmp_path):
    """A few dozen SGD dialogues through the stock ChatML template (no generation markers), a head, and an eval."""
    data = write_jsonl(tmp_path / "sgd.jsonl", sgd_rows(24, split="dev"))
    recipe = make_recipe(
        tmp_path, data, target={"path": str(SMOLLM2), "dtype": "float32"},
        data={"max_length": 192, "heldout_rows": 4},
        precompute={"layers": [-1], "topk": 8, "shard_tokens": 2048, "batch_tokens": 2048},
        head={"init": "target_last_layer"},
        train={"batch_tokens": 1024, "lr": 1e-3, "warmup_steps": 2, "max_steps": 6, "val_every": 6,
               "save_every": 6, "wandb_mode": "disabled"},
        eval={"k": [2], "temperatures": [0.0], "prompt_sets": ["heldout"], "max_prompts": 4, "max_new_tokens": 12,
              "batch_size": 4},
    )
    proc = run_cli(recipe, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "masked in" in proc.stderr
    features = tmp_path / "run" / "features"
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["complete"] and manifest["hidden_size"] == 576
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    row = reader.load(reader.sequences[0])
    ids, mask = row["input_ids"].tolist(), row["loss_mask"].bool().tolist()
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "<|im_start|>" not in masked and masked.count("<|im_end|>") >= 1
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless"] is True
    assert not report["val_mismatch"]
    assert 1.0 <= report["tau"] <= 3.0


@needs_model
@pytest.mark.slow
def test_regeneration_on_general_prompts_writes_what_transformers_generates(models, tmp_path):
    """Precompute regenerates shipped Dolly prompts: the kept answers and the masked tokens are the target's
    greedy answers, as transformers generates them."""
    import gzip

    tokenizer, _, hf, _ = models
    with gzip.open(REPO / "data/general/prompts.jsonl.gz", "rt") as f:
        rows = [json.loads(next(f)) for _ in range(4)]
    data = write_jsonl(tmp_path / "general.jsonl", rows)
    recipe = make_recipe(
        tmp_path, data, target={"path": str(SMOLLM2), "dtype": "float32"},
        data={"format": "openai", "max_length": 512, "heldout_rows": 0, "regenerate": True,
              "sampling": {"temperature": 0.0, "max_new_tokens": 16}},
        precompute={"layers": [-1], "topk": 8, "shard_tokens": 4096, "batch_tokens": 2048},
    )
    proc = run_cli("precompute", recipe, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "regenerate: 4/4 rows" in proc.stderr and "tok/s" in proc.stderr
    features = tmp_path / "run" / "features"
    lines = (features / "regenerated.rank-00000.jsonl").read_text().splitlines()
    kept = {json.loads(x)["row_id"]: json.loads(x)["messages"] for x in lines[1:]}
    assert sorted(kept) == [0, 1, 2, 3]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, row in enumerate(rows):
        prompt = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(prompt):].tolist()
        answer = tokenizer.decode([t for t in ref if t != eos], skip_special_tokens=True)
        assert kept[i] == [row["messages"][0], {"role": "assistant", "content": answer}]
        assert answer != row["messages"][1]["content"]
