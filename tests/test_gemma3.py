"""Gemma 3 in the runtime: its config (windowed and global layers, a rope per kind, the refusals), its windows in
force, and parity with transformers on the released weights (``make gemma3``; those tests skip without them). The
random-weight parity of every step shape is tests/test_runtime_parity.py's, over ``gemma3_text`` among the families.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from hf_models import hf_config, save_random_model
from mtp_train.errors import UserError
from mtp_train.models.config import ModelConfig
from mtp_train.runtime.engine import Engine
from test_runtime_parity import assert_close, decode_logits, random_sequences

GEMMA3 = REPO / ".cache" / "gemma-3-270m"
needs_model = pytest.mark.skipif(not (GEMMA3 / ".complete").is_file(),
                                 reason=f"{GEMMA3} is absent: run `make gemma3` to fetch and convert it")


def test_the_config_gives_each_layer_its_window_and_rope():
    cfg = ModelConfig.from_hf(hf_config("gemma3_text").to_dict())
    assert cfg.layer_windows == (12, 0, 12) and [cfg.layer_window(i) for i in range(3)] == [12, None, 12]
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 1e4) and cfg.sliding_window is None
    assert cfg.norm_offset == 1.0 and cfg.embed_scale == 64**0.5 and cfg.torch_only
    released = {**hf_config("gemma3_text").to_dict(), "rope_parameters": None, "rope_theta": 1e6,
                "rope_local_base_freq": 1e4, "rope_scaling": None}  # google/gemma-3-270m's config.json keys
    assert ModelConfig.from_hf(released) == cfg
    assert ModelConfig.from_json(__import__("dataclasses").asdict(cfg)) == cfg  # as a head's config stores it


@pytest.mark.parametrize("change, message", [
    ({"query_pre_attn_scalar": 32}, "query_pre_attn_scalar 32 is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must give"),
])
def test_what_the_runtime_does_not_implement_is_refused_in_one_line(change, message):
    with pytest.raises(UserError, match=message):
        ModelConfig.from_hf({**hf_config("gemma3_text").to_dict(), **change}, "config.json")


def test_the_windows_are_in_force(tmp_path):
    """The same weights with every layer global (one rope for both kinds, so that only the windows differ): the
    logits agree up to the window and differ past it."""
    rope = dict(rope_type="default", rope_theta=1e4)
    one_rope = {"rope_parameters": {"sliding_attention": rope, "full_attention": rope}}
    model = save_random_model("gemma3_text", tmp_path / "window", **one_rope)
    save_random_model("gemma3_text", tmp_path / "full", layer_types=["full_attention"] * 3, **one_rope)
    (tokens,) = random_sequences(model.config.vocab_size, [30], seed=1)
    ours = decode_logits(Engine.from_pretrained(tmp_path / "window", page_size=4), tokens, prefill=5)
    full = decode_logits(Engine.from_pretrained(tmp_path / "full", page_size=4), tokens, prefill=5)
    window = model.config.sliding_window  # rows are positions 4..29
    assert_close(ours[: window - 4], full[: window - 4])
    assert (ours[window - 4:] - full[window - 4:]).abs().amax(-1).min() > 1e-3


def test_the_windowed_layers_keep_only_their_window_of_pages(tmp_path):
    """Gemma 3's windowed layers (window 12) cache on a pool of their own, sized for 2 sequences' windows and one step
    of 64 tokens, the global layers taking the rest of the bytes; a 40-token prompt decoding 30 more holds, after its
    prefill, no windowed pages below its window while the global layers keep every page, and gives transformers'
    greedy tokens (each from a whole forward of its prefix)."""
    from mtp_train.runtime.sampling import SamplingParams

    hf = save_random_model("gemma3_text", tmp_path).eval()
    (prompt,) = random_sequences(256, [40], seed=3)
    params = SamplingParams(max_new_tokens=30, stop_token_ids=())
    engine = Engine.from_pretrained(tmp_path, page_size=4, num_pages=64, max_seqs=2, max_batch_tokens=64)
    alloc = engine.allocator
    assert alloc.windowed.num_pages == 2 * (3 + 1) + 16 + 2 and alloc.num_pages == 64 + (64 - 26) * 2
    assert engine.kv.window_k.shape[:2] == (2, 27) and engine.kv.k.shape[:2] == (1, 140)  # (a stand-in page too)
    scheduler, (seq,) = engine.start([prompt], params)
    held = []
    while not scheduler.done:
        engine.step(scheduler)
        if not scheduler.done:
            real = [p for p in seq.pages.window.pages if p != alloc.windowed.stand_in]
            held.append((len(real), len(seq.pages.pages), alloc.windowed.num_pages - alloc.windowed.num_free))
    assert held[0][0] == 10 and max(w for w, _, _ in held[1:]) <= 12 // 4 + 2  # after the prefill: the window's
    assert held[-1][1] == (40 + 28) // 4 and all(w == used for w, _, used in held)
    (ours,) = engine.generate([prompt], params)
    ref = list(prompt)
    with torch.no_grad():  # (each token from a whole forward: transformers' own windowed cache decodes otherwise here)
        for _ in range(30):
            ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
    assert ours.tokens == ref[40:]


@pytest.fixture(scope="module")
def released():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GEMMA3)
    hf = AutoModelForCausalLM.from_pretrained(GEMMA3, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(GEMMA3, dtype=torch.float32, device=torch.device("cpu"))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    long = tokenizer((REPO / "docs" / "targets.md").read_text()).input_ids[:900]  # past the 512-token window
    return tokenizer, hf, engine, [chat, long]


@needs_model
@pytest.mark.slow
def test_score_matches_transformers_on_the_released_weights(released):
    _, hf, engine, prompts = released
    assert len(prompts[1]) == 900 > engine.cfg.layer_windows[0] == 512
    out = engine.score(prompts, layers=[-1], topk=16)
    for i, seq in enumerate(prompts):
        a, b = out.cu_seqlens[i], out.cu_seqlens[i + 1]
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0].float()
        values, ids = torch.log_softmax(logits, -1).topk(16, -1)
        assert (out.topk_logprobs[a:b] - values).abs().max() <= 1e-4
        assert (out.topk_ids[a:b, 0] == ids[:, 0]).all()
        assert (out.logsumexp[a:b] - torch.logsumexp(logits, -1)).abs().max() <= 1e-4


@needs_model
@pytest.mark.slow
def test_greedy_generate_matches_transformers_over_64_tokens(released):
    from mtp_train.runtime.sampling import SamplingParams

    _, hf, engine, prompts = released
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=64))
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
        assert result.tokens == ref and len(ref) == 64


@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
@pytest.mark.parametrize("tree", [None, (4, 4, 8)])
def test_chains_and_trees_on_a_target_with_windowed_layers_are_lossless(tmp_path, tree, family):
    """The target drafting for itself (every greedy draft right, so every verify runs deep), on prompts and outputs
    longer than its window (Gemma 3's windowed layers; Mistral's window over every layer), 4 sequences in 24 pages
    of 4 (preemptions): a chain at k = 3 and a tree give plain greedy decoding's tokens."""
    from mtp_train.models.checkpoint import load_transformer
    from mtp_train.runtime.drafters import DraftModelDrafter
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.speculative import SpeculativeDecoder
    from mtp_train.runtime.tree import TreeShape
    from mtp_train.runtime.tree_decoder import TreeDecoder

    save_random_model(family, tmp_path)
    prompts = random_sequences(256, [5, 17, 30, 9], seed=5)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    plain = [r.tokens for r in Engine.from_pretrained(tmp_path, page_size=4).generate(prompts, params)]
    engine = Engine.from_pretrained(tmp_path, page_size=4, num_pages=24, max_seqs=4)
    drafter = DraftModelDrafter(engine, load_transformer(tmp_path))
    decoder = (SpeculativeDecoder(engine, drafter, 3) if tree is None
               else TreeDecoder(engine, drafter, TreeShape(*tree)))
    out = decoder.generate(prompts, params)
    assert [r.tokens for r in out] == plain and decoder.greedy_violations == 0
    assert sum(a for r in out for a in r.stats.accepted) > 0 and sum(r.stats.preemptions for r in out) > 0


def test_the_trainers_frozen_parts_are_the_targets_and_a_heads_layer_is_a_llama_layer(tmp_path):
    """FrozenTarget's embedding (times √hidden) and final norm (by 1 + w) equal transformers' Gemma 3 modules, and
    an eagle3 head for it has a Llama decoder layer of its sizes (no norms after attention or MLP, SiLU)."""
    from mtp_train.heads import build_head, head_spec
    from mtp_train.heads.frozen import FrozenTarget

    model = save_random_model("gemma3_text", tmp_path)
    frozen = FrozenTarget.load(tmp_path)
    tokens, hidden = torch.tensor([3, 17, 200]), torch.randn(3, 64)
    with torch.no_grad():
        assert torch.allclose(frozen.embed(tokens), model.model.embed_tokens(tokens[None])[0], atol=1e-6)
        assert torch.allclose(frozen.final_norm(hidden), model.model.norm(hidden), atol=1e-5)
    head = build_head(head_spec("eagle3", 1, frozen.cfg, "x", aux_layers=(1, 2, 3), draft_vocab=64))
    layer = head.layers[0]
    assert layer.post_attention_norm is None and not layer.feed_forward.gelu and layer.attention.q_norm is None
    assert layer.attention_norm.offset == 0.0 and head.rope.inv_freq[1] == frozen.cfg.rope.theta ** (-2 / 16)
