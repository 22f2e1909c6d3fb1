"""Engine behaviour: greedy equivalence with transformers, batch invariance, page sizes, page pressure, score()."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TARGET, sgd_chat_prompts
from hf_models import save_random_model
from mtp_train.errors import UserError
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams

NO_STOP = SamplingParams(max_new_tokens=64, stop_token_ids=())


@pytest.fixture(scope="module")
def hf_tiny():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as NO_STOP does
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """8 chat prompts of different lengths from the SGD dev split (1 to 8 user/assistant turns)."""
    out = sgd_chat_prompts(8, 8)
    assert len({len(p) for p in out}) == 8
    return out


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(TINY_TARGET, page_size=16)


def test_greedy_generate_equals_transformers(engine, hf_tiny, prompts):
    ours = engine.generate(prompts, NO_STOP)
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_tiny.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, pad_token_id=2)
        assert result.tokens == ref[0, len(prompt):].tolist()
        assert result.stats.generated_tokens == 64 and result.stats.finish_reason == "length"


def test_batch_invariance(engine, prompts):
    batched = engine.generate(prompts, NO_STOP)
    for prompt, together in zip(prompts, batched):
        assert engine.generate([prompt], NO_STOP)[0].tokens == together.tokens


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_equals_contiguous(page_size, prompts):
    params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    contiguous = Engine.from_pretrained(TINY_TARGET, page_size=2048, num_pages=len(prompts))
    paged = Engine.from_pretrained(TINY_TARGET, page_size=page_size)
    assert [r.tokens for r in paged.generate(prompts, params)] == [r.tokens for r in contiguous.generate(prompts, params)]
    a, b = paged.score(prompts, topk=8), contiguous.score(prompts, topk=8)
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert (a.topk_logprobs - b.topk_logprobs).abs().max() <= 1e-5


def test_page_exhaustion_completes_every_request_correctly(prompts):
    params = SamplingParams(max_new_tokens=40, stop_token_ids=())
    roomy = Engine.from_pretrained(TINY_TARGET, page_size=16)
    worst = max(len(p) for p in prompts) + 40
    tight = Engine.from_pretrained(TINY_TARGET, page_size=16, num_pages=-(-worst // 16) + 1)
    expected = [r.tokens for r in roomy.generate(prompts, params)]
    results = tight.generate(prompts, params)
    assert [r.tokens for r in results] == expected
    assert sum(r.stats.preemptions for r in results) > 0, "the budget must actually force preemption"
    assert tight.allocator.num_free == tight.allocator.num_pages, "every page is returned"


def test_request_larger_than_the_cache_is_a_clear_error(prompts):
    tiny = Engine.from_pretrained(TINY_TARGET, page_size=16, num_pages=2)
    with pytest.raises(UserError, match="exceed the KV cache"):
        tiny.generate([prompts[-1]], NO_STOP)


def test_stops_at_end_of_turn(engine, prompts):
    eot = engine.stop_ids[0]
    result = engine.generate([prompts[0]], SamplingParams(max_new_tokens=200))[0]
    assert result.tokens[-1] in engine.stop_ids and result.stats.finish_reason == "stop"
    assert eot in engine.stop_ids


def test_sampling_is_seeded_per_request(engine, prompts):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=32, seed=7, stop_token_ids=())
    first = [r.tokens for r in engine.generate(prompts[:3], p)]
    again = [r.tokens for r in engine.generate(prompts[:3], p)]
    other = [r.tokens for r in engine.generate(prompts[:3], SamplingParams(**{**p.__dict__, "seed": 8}))]
    assert first == again
    assert first != other


def test_score_matches_transformers_hidden_states_and_topk(tmp_path):
    model = save_random_model("llama", tmp_path)
    engine = Engine.from_pretrained(tmp_path, max_batch_tokens=48)  # forces several packed batches
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 30, 12, 25)]
    out = engine.score(seqs, layers=[0, 1, -1], topk=16)
    assert out.hidden.shape == (sum(map(len, seqs)), 3, 64)
    assert out.layers == [0, 1, 2]
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.update(last=o[0] if isinstance(o, tuple) else o))
    for i, seq in enumerate(seqs):
        a, b = out.cu_seqlens[i], out.cu_seqlens[i + 1]
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True)
        for j, layer in enumerate([0, 1]):
            assert (out.hidden[a:b, j] - ref.hidden_states[layer + 1][0]).abs().max() <= 1e-5
        last = captured["last"][0]
        assert (out.hidden[a:b, 2] - last).abs().max() <= 1e-5, "last layer is stored before the final norm"
        assert not torch.allclose(last, ref.hidden_states[-1][0]), "HF's last entry is post-norm"
        logprobs = torch.log_softmax(ref.logits[0].float(), -1)
        values, ids = torch.topk(logprobs, 16)
        assert torch.equal(out.topk_ids[a:b], ids)
        assert (out.topk_logprobs[a:b] - values).abs().max() <= 1e-5
        assert (out.logsumexp[a:b] - torch.logsumexp(ref.logits[0].float(), -1)).abs().max() <= 1e-5
        rest = torch.log_softmax(ref.logits[0].double(), -1).scatter(-1, ids, float("-inf")).logsumexp(-1)
        assert (out.tail_logprob[a:b].double() - rest).abs().max() <= 1e-4, "exact mass outside the top-K"
    hook.remove()
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_unsupported_model_type_names_it(tmp_path):
    save_random_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        Engine.from_pretrained(tmp_path)


def test_missing_weight_names_the_key(tmp_path):
    from safetensors.torch import load_file, save_file

    save_random_model("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        Engine.from_pretrained(tmp_path)
