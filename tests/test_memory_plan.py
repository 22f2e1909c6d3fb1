"""The memory plan per rank (``mtp_train.memory``): its parts are the runtime's real sizes, the head's
activations are what autograd saves, and the shipped big recipes carry the plan the code computes."""

from __future__ import annotations

import json
import re

import torch

import pytest

from conftest import REPO, TINY_RECIPE, TINY_TARGET
from hf_models import save_random_model
from mtp_train.head_memory import (attention_kernel, head_activation_bytes_per_token, head_activation_terms,
                                   head_parameter_count, head_saved_bytes, loss_copy_bytes, train_activation_bytes)
from mtp_train.heads.attention import ATTENTION_PEAK_BYTES
from mtp_train.memory import H100_BYTES, kv_bytes_per_token, memory_plan, plan_lines, target_weight_bytes
from mtp_train.runtime.reserve import flashinfer_backend_bytes, reserved_bytes
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe

CONFIGS = REPO / "recipes" / "configs"
BIG = [("llama3.1-8b", CONFIGS / "llama-3.1-8b.json"), ("llama3.3-70b", CONFIGS / "llama-3.3-70b.json"),
       ("deepseek-v2-lite", CONFIGS / "deepseek-v2-lite" / "config.json")]
V2_LITE = CONFIGS / "deepseek-v2-lite" / "config.json"


def _config(path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(path.read_text()))


def test_weight_and_kv_sizes_are_the_runtimes():
    from mtp_train.runtime.engine import Engine

    engine = Engine.from_pretrained(TINY_TARGET, num_pages=10)
    cfg = engine.cfg
    loaded = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert not cfg.tie_word_embeddings  # (a tied lm_head would be one tensor, counted once here)
    assert target_weight_bytes(cfg, 1, 4) == loaded
    pool = engine.kv.k.numel() * 4 + engine.kv.v.numel() * 4
    assert kv_bytes_per_token(cfg, 1, 4) * 10 * engine.allocator.page_size == pool


@pytest.mark.parametrize("precision", ["auto", "no"])
def test_head_activations_are_what_autograd_saves_on_a_real_forward(precision):
    """The per-token count (fake tensors under bf16 autocast, the plan's default on a GPU; the meta device in fp32)
    equals what a real CPU forward of the tiny target's head keeps under the same autocast, per token between two
    lengths; bf16 keeps about half of fp32."""
    from mtp_train.head_memory import autocast_dtype, counting, saved_storages
    from mtp_train.heads import build_head, head_spec

    recipe = load_recipe(TINY_RECIPE, [f'train.mixed_precision="{precision}"'])
    cfg = _config(TINY_TARGET / "config.json")
    per_token = head_activation_bytes_per_token(recipe, cfg)
    head = build_head(head_spec(recipe.head.kind, recipe.head.num_layers, cfg, "x"))

    def kept(tokens: int) -> int:
        pack, held = saved_storages(list(head.parameters()))
        with counting(autocast_dtype(recipe), "cpu"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = head(torch.randn(tokens, cfg.hidden_size), torch.randn(tokens, cfg.hidden_size),
                       torch.arange(tokens) % 512, list(range(0, tokens + 1, 512)))
        assert out.dtype == (torch.bfloat16 if precision == "auto" else torch.float32)
        return held()

    assert (kept(2048) - kept(1024)) // 1024 == per_token
    fp32 = head_activation_bytes_per_token(load_recipe(TINY_RECIPE, ['train.mixed_precision="no"']), cfg)
    assert per_token == fp32 if precision == "no" else 0.4 * fp32 < per_token < 0.7 * fp32


def test_the_big_recipes_state_the_plan_the_code_computes_and_fit():
    for name, config in BIG:
        recipe_file = REPO / "recipes" / f"{name}.yaml"
        recipe = load_recipe(recipe_file)
        cfg = _config(config)
        comments = recipe_file.read_text()
        for line in plan_lines(cfg, recipe)[1:]:
            assert f"# {line}\n" in comments, f"{name}.yaml's memory comment is stale: {line}"
        assert all(stage.fits for stage in memory_plan(cfg, recipe)), name


def test_a_batch_too_large_for_the_gpu_is_reported():
    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b.yaml", ["train.batch_tokens=131072", "train.grad_accum=1"])
    cfg = _config(CONFIGS / "llama-3.1-8b.json")
    runtime, train, _ = memory_plan(cfg, recipe, H100_BYTES)
    assert runtime.fits and not train.fits
    assert "DOES NOT FIT" in train.line() and train.parts["activations"] > 80 * 2**30


def test_the_dry_run_prints_the_plan(cli):
    proc = cli(TINY_RECIPE, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if re.match(r"\s+(precompute|train|eval)\s", l)]
    assert len(lines) == 3 and all("fits" in l for l in lines)


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek(request, tmp_path_factory):
    """A small random DeepSeek model saved by transformers (MLA; one dense layer, then experts with shared experts;
    V3: a q LoRA and the router's correction bias), and its config."""
    root = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(request.param, root)
    return root, hf, _config(root / "config.json")


def test_deepseek_weight_bytes_are_the_real_models_per_rank(deepseek):
    """MLA's latent projection replicated and its heads split, every expert on every rank sliced by channel, the
    router float32: the plan's bytes per rank are those of transformers' model and of the runtime's, at TP 1 and 2."""
    from mtp_train.models.checkpoint import load_transformer
    from mtp_train.models.tp import TensorParallel

    root, hf, cfg = deepseek
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.first_dense_layers == 1
    real = sum(p.numel() for p in hf.parameters()) + sum(  # + V3's router bias, a buffer in HF
        b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert target_weight_bytes(cfg, 1, 4) == real * 4
    for tp in (1, 2):
        meta = load_transformer(root, device="meta", tp=TensorParallel(rank=0, size=tp))
        assert target_weight_bytes(cfg, tp, 4) == sum(p.numel() for p in meta.parameters()) * 4
        for rank in range(tp):  # loaded in bf16: the router stays float32
            model = load_transformer(root, dtype=torch.bfloat16, tp=TensorParallel(rank=rank, size=tp))
            assert target_weight_bytes(cfg, tp, 2) == sum(p.numel() * p.element_size() for p in model.parameters())
    # The replicated latent projection is why TP 2 holds more than half.
    assert target_weight_bytes(cfg, 2, 2) > target_weight_bytes(cfg, 1, 2) // 2


def test_mla_kv_bytes_per_token_are_the_pools_latent(deepseek):
    """One latent (kv_lora_rank + qk_rope_head_dim) per token and layer, the same on every TP rank, not
    2 x heads x head_dim: what the engine's pool allocates and what ``KVPool.pages_for_budget`` sizes it by."""
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.kv_cache import KVPool

    root, _, cfg = deepseek
    engine = Engine.from_pretrained(root, num_pages=10)
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    assert latent == 512 + 64
    per_token = kv_bytes_per_token(cfg, 1, 4)
    assert per_token == cfg.num_layers * latent * 4 != 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert per_token * 10 * engine.allocator.page_size == engine.kv.k.numel() * 4 + engine.kv.v.numel() * 4
    lite = _config(V2_LITE)
    for tp in (1, 2, 8):
        per_token = kv_bytes_per_token(lite, tp, 2)
        assert per_token == 27 * (512 + 64) * 2 == 31_104
        for pages in (1, 1000):
            budget = pages * 16 * per_token
            assert KVPool.pages_for_budget(lite, 16, budget, torch.bfloat16, tp) == pages
            assert KVPool.pages_for_budget(lite, 16, budget + 16 * per_token - 1, torch.bfloat16, tp) == pages


def test_deepseek_head_parameters_are_its_layer_and_the_mtp_parts(deepseek):
    """An ``mtp`` head on a DeepSeek target: one decoder layer of MLA with the MLP its spec asks for (the target's
    dense MLP, or its experts when ``HeadSpec.moe``), the layer's two norms, and enorm, hnorm, eh_proj and
    shared_head.norm; the layer's count is that of transformers' layer of the same kind."""
    from mtp_train.heads import head_spec

    _, hf, cfg = deepseek
    recipe = load_recipe(TINY_RECIPE)
    moe = getattr(head_spec("mtp", 1, cfg, "x"), "moe", False)
    layer = hf.model.layers[1 if moe else 0]  # layer 0 is dense (first_k_dense_replace 1), the others have experts
    h = cfg.hidden_size
    expected = sum(p.numel() for p in layer.parameters()) + 3 * h + 2 * h * h
    expected += sum(b.numel() for name, b in layer.named_buffers() if name.endswith("e_score_correction_bias"))
    assert head_parameter_count(recipe, cfg) == expected


def test_mla_head_activations_are_what_autograd_saves_on_a_real_forward(deepseek):
    """The MLA head's attention (a 576-wide key head, which no fused kernel takes) runs ``range_attention``, which
    keeps no scores: the term measured on the meta device is linear, and predicts what a real CPU forward over
    several packed documents keeps."""
    _, _, cfg = deepseek
    recipe = load_recipe(TINY_RECIPE)
    assert attention_kernel(recipe, cfg) == "chunked"
    linear, quadratic = head_activation_terms(recipe, cfg)
    steps = recipe.train.unroll
    assert linear > steps * cfg.hidden_size * 4 and quadratic == 0
    # a real forward under the plan's bf16 autocast; the difference of two batches leaves out autocast's weight copies
    real = head_saved_bytes(recipe, cfg, [0, 96, 256, 300], device="cpu") - head_saved_bytes(recipe, cfg, [0, 96],
                                                                                             device="cpu")
    assert steps * real == linear * 204


def test_the_plan_counts_the_attention_kernel_a_gpu_selects():
    """bf16 (the default on CUDA) runs a flash kernel, which keeps no scores; fp32 runs the math kernel, whose scores
    grow with the square of each document: the plan counts them (the 8B recipe in fp32 does not fit), measured on the
    meta device. eagle3's training-time test runs ``range_attention``: no scores kept, and the 8B plan fits."""
    cfg = _config(CONFIGS / "llama-3.1-8b.json")
    name = REPO / "recipes" / "llama3.1-8b.yaml"
    default, fp32, eagle3 = (load_recipe(name, o) for o in ([], ['train.mixed_precision="no"'], ["head.kind=eagle3"]))
    assert [attention_kernel(r, cfg) for r in (default, fp32, eagle3)] == ["flash", "math", "chunked"]
    assert head_activation_terms(default, cfg)[1] == head_activation_terms(eagle3, cfg)[1] == 0
    quadratic = head_activation_terms(fp32, cfg)[1]
    assert quadratic >= fp32.train.unroll * cfg.num_heads * 4  # [heads, L, L] fp32 per step at least
    train = memory_plan(cfg, fp32)[1]
    assert not train.fits and "the math attention kernel's scores of documents up to 4,096 tokens" in train.line()
    assert "the flash attention kernel)" in memory_plan(cfg, default)[1].line()
    assert memory_plan(cfg, eagle3)[1].fits and "the chunked attention kernel)" in memory_plan(cfg, eagle3)[1].line()


@pytest.mark.parametrize("kind", ["mtp", "eagle", "eagle3"])
@pytest.mark.parametrize("teacher", ["topk", "exact"])
@pytest.mark.parametrize("precision", ["auto", "no"])
def test_the_plan_bounds_what_a_real_training_step_keeps_loss_included(kind, teacher, precision):
    """A real CPU forward of the objective (the head's unrolled steps and the loss, with the masked rows it
    gathers) keeps at most what the plan's activations and loss copies say, and not much less: within 15% in fp32,
    25% under bf16 autocast (the plan's default on a GPU), where the loss's gathered rows are counted at fp32 width
    (eagle's are bf16).
    eagle3 runs ``range_attention``, as on a GPU (its chunks' scores are a transient bound in the plan, not kept);
    the others SDPA's flash kernel under bf16 and its math kernel in fp32, as a GPU picks them."""
    import weakref

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mtp_train.head_memory import autocast_dtype, counting
    from mtp_train.heads import build_head, head_spec
    from mtp_train.heads.eagle3 import aux_layers_for
    from mtp_train.heads.frozen import FrozenTarget
    from mtp_train.train.data import Batch
    from mtp_train.train.objective import loss_weights, objective
    from mtp_train.train.vocab import draft_vocab_size

    recipe = load_recipe(TINY_RECIPE, [f"head.kind={kind}", f"train.teacher={teacher}", "train.unroll=3",
                                       "train.batch_tokens=1024", "data.max_length=256",
                                       f'train.mixed_precision="{precision}"'])
    cfg = _config(TINY_TARGET / "config.json")
    torch.manual_seed(0)
    eagle3 = kind == "eagle3"
    head = build_head(head_spec(kind, 1, cfg, "x", recipe.head.convention,
                                tuple(aux_layers_for(recipe.head.aux_layers, cfg)) if eagle3 else (),
                                draft_vocab_size(recipe.head.draft_vocab, cfg.vocab_size) if eagle3 else 0))
    h, v, k, n = cfg.hidden_size, cfg.vocab_size, recipe.precompute.topk, 1024
    # eagle3 counts a row only where the target's top-1 lies in its draft vocabulary (ids 0..N-1 before any
    # training); the plan takes every row, so here every top-1 lies there (the exact teacher's: the lm_head's rows
    # outside it small)
    top = head.draft_ids.numel() if eagle3 else v
    lm_head = torch.randn(v, h) * torch.where(torch.arange(v) < top, 1.0, 1e-3)[:, None]
    frozen = FrozenTarget(cfg, torch.randn(v, h), torch.ones(h), lm_head)
    batch = Batch(torch.randint(0, v, (n,)), torch.randn(n, h), torch.ones(n, dtype=torch.bool),
                  torch.randn(n, k).log_softmax(-1), torch.randint(0, top, (n, k)), torch.full((n,), -3.0),
                  [0, 256, 512, 768, 1024], torch.randn(n, 3 * h) if eagle3 else None)
    held = [*head.parameters(), frozen.embed_weight, frozen.norm_weight, frozen.lm_head_weight, batch.tokens,
            batch.hidden, batch.loss_mask, batch.topk_logprobs, batch.topk_ids, batch.tail_logprob, batch.aux]
    skip = {t.untyped_storage()._cdata for t in held if t is not None}
    saved: list[weakref.ref] = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if precision == "auto" else [SDPBackend.MATH]
    with sdpa_kernel(kernels), counting(autocast_dtype(recipe), "cpu"), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the plan's bf16 autocast, as on a GPU
        loss, _ = objective(head, frozen, batch, loss_weights(recipe))
    kept = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (r() for r in saved)
            if t is not None and t.untyped_storage()._cdata not in skip}
    measured = sum(kept.values())
    transient = ATTENTION_PEAK_BYTES if eagle3 else 0
    planned = train_activation_bytes(recipe, cfg) - transient + loss_copy_bytes(recipe, cfg)
    assert measured <= planned <= (1.15 if precision == "no" else 1.25) * measured, (measured, planned)


def test_the_memory_module_plans_a_deepseek_recipe_from_its_config_alone(capsys):
    from mtp_train.memory import main

    assert main([str(REPO / "recipes" / "deepseek-v2-lite.yaml"), str(V2_LITE)]) == 0
    out = capsys.readouterr().out
    assert "weights 29.3 " in out and "31,104 B (MLA latent 512+64 x 27 layers" in out and "DOES NOT FIT" not in out


def test_the_eval_counts_its_drafts_weights_and_pools_inside_one_budget():
    """At 70B the eval's heads and their K/V pools come out of the same budget as the target's KV, on the leader."""
    recipe = load_recipe(REPO / "recipes" / "llama3.3-70b.yaml", ["eval.compare=[eagle, bigram]"])
    cfg = _config(CONFIGS / "llama-3.3-70b.json")
    precompute, _, evaluation = memory_plan(cfg, recipe, H100_BYTES)
    heads = (head_parameter_count(recipe, cfg, "mtp") + head_parameter_count(recipe, cfg, "eagle")) * 2
    assert evaluation.parts["heads"] == heads > 2**30
    # one budget: fraction x GPU - weights - heads - the buffers of 3 FlashInfer backends (engine, 2 drafters)
    buffers = reserved_bytes(3, recipe.target.tp)
    assert evaluation.parts["buffers"] == buffers == precompute.parts["buffers"] + 2 * flashinfer_backend_bytes()
    assert evaluation.parts["KV"] == precompute.parts["KV"] - heads - 2 * flashinfer_backend_bytes()
    assert evaluation.fits and evaluation.total <= precompute.total
    assert "shared by the target and 2 head(s) (mtp, eagle)" in evaluation.line()
    assert H100_BYTES == int(79.2 * 2**30)  # what mem_get_info reports, the runtime's base for gpu_memory_fraction
