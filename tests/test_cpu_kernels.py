"""The runtime's CPU kernels, each against torch's ops: the small-row matmul, the paged attention in one call, and a
whole decoder layer in one call (every family it runs, and an EAGLE-3 head's layer)."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import TINY_TARGET
from mtp_train.models.config import ModelConfig
from mtp_train.runtime.batch import build_batch
from mtp_train.runtime.kv_cache import PageAllocator, PageTable


def test_the_small_row_kernel_equals_blas_at_every_row_count():
    """The packed kernel multiplies a few rows by a weight whose sizes are not multiples of its blocks (a last,
    partial block of outputs) as F.linear does, up to rounding; it builds on this machine (g++ and ninja are
    installed with the project), so the engine's decode steps use it."""
    import torch.nn.functional as F

    from mtp_train.runtime import small_rows

    assert small_rows.kernel() is not None, "the small-row kernel did not build here"
    weight = torch.randn(77, 45)
    packed = small_rows.pack(weight)
    assert packed.shape == (3, 45, 32)
    for rows in (*range(1, 10), 16, 21):  # past 8 rows, in chunks of 8 per read of the weight
        x = torch.randn(rows, 45)
        assert torch.allclose(small_rows.linear(x, packed, 77), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    x = torch.randn(21, 45)
    assert torch.equal(small_rows.linear(x, packed, 77)[16:], small_rows.linear(x[16:], packed, 77)), \
        "each row's products are the same whatever rows it comes with"


def test_a_bf16_packed_weight_multiplies_as_its_float32_copy_bit_for_bit():
    """A weight whose values all are bfloat16 (a checkpoint stored in bf16) is packed in half the bytes and gives the
    float32 packing's products exactly; a float32 weight is not taken for one."""
    from mtp_train.runtime import small_rows

    weight = torch.randn(77, 45).bfloat16().float()
    assert small_rows.exactly_bf16(weight) and not small_rows.exactly_bf16(torch.randn(77, 45))
    wide, narrow = small_rows.pack(weight), small_rows.pack(weight, bf16=True)
    assert narrow.dtype == torch.bfloat16 and narrow.shape == wide.shape
    for rows in (*range(1, 10), 20):
        x = torch.randn(rows, 45)
        assert torch.equal(small_rows.linear(x, narrow, 77), small_rows.linear(x, wide, 77)), rows


def _step(cached: list[int], new: list[int], page: int = 4, pages: int = 32):
    """Batch metadata for sequences holding ``cached`` tokens that append ``new`` ones."""
    alloc = PageAllocator(pages, page)
    tables = [PageTable() for _ in cached]
    for table, c, n in zip(tables, cached, new):
        alloc.reserve(table, c + n)
    return build_batch([list(range(n)) for n in new], cached, [t.pages for t in tables], page, torch.device("cpu"))


@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_the_one_call_paged_attention_equals_the_sdpa_path(heads):
    """A decode and verify step's attention in one kernel call (RoPE, cache writes, softmax over the pages) gives
    the SDPA path's output and writes the same keys and values, for sequences of 1 to 5 new tokens at any cached
    length (a fresh one too), across page boundaries, with grouped-query heads."""
    from mtp_train.models.config import RopeConfig
    from mtp_train.models.rope import RotaryEmbedding
    from mtp_train.runtime import small_rows
    from mtp_train.runtime.attention import TorchAttention

    n_heads, n_kv, dim = *heads, 16
    g = torch.Generator().manual_seed(0)
    meta = _step([7, 0, 12, 3], [1, 5, 3, 2])
    cos_sin = RotaryEmbedding(dim, RopeConfig(theta=10000.0)).cos_sin(meta.positions, torch.float32)
    qkv = torch.randn(meta.tokens.numel(), (n_heads + 2 * n_kv) * dim, generator=g)
    caches = [torch.randn(32, 4, n_kv, dim, generator=g) for _ in range(2)]
    fused_k, fused_v = (c.clone() for c in caches)
    fused = small_rows.attend(qkv, *cos_sin, fused_k, fused_v, meta.slot_mapping, meta.qo_indptr.long(),
                              meta.kv_lens.long(), meta.page_indptr.long(), meta.page_indices.long(), n_heads, n_kv,
                              dim**-0.5)
    q, k, v = qkv.view(-1, n_heads + 2 * n_kv, dim).split([n_heads, n_kv, n_kv], dim=1)
    q, k = RotaryEmbedding.rotate(torch.cat([q, k], 1), *cos_sin).split([n_heads, n_kv], dim=1)
    ref_k, ref_v = (c.clone() for c in caches)
    ref = TorchAttention().plan(meta, n_heads, n_kv, dim).attend(q, k, v, ref_k, ref_v).reshape(fused.shape)
    assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(fused_k, ref_k, atol=1e-6) and torch.equal(fused_v, ref_v)


@pytest.mark.parametrize("order", [[7, 0, 12, 3, 0, 30], [0, 7, 12, 0, 3, 30]])
@pytest.mark.parametrize("heads", [(4, 2, 16), (12, 1, 16), (4, 2, 24)])
def test_a_wide_steps_cached_sequences_attend_in_one_kernel_call_as_sdpa_does(order, heads):
    """A step of many rows on CPU attends its sequences with cached keys in one call of the paged kernel
    (``attend_paged``) and its fresh prefills by SDPA: the same output as every sequence by SDPA (``stored_layout``),
    whether the cached ones are neighbours in the batch or not; a mutant that skips the kernel's part leaves rows
    unwritten and fails. The kernel's AVX-512 path takes a head dimension that is a multiple of 16 (the first two
    cases; the second's 12 query heads per key-value head split into work items of 8 and 4) and its portable path
    the rest (24)."""
    from mtp_train.models.parts import stored_layout
    from mtp_train.runtime.attention import TorchAttention

    n_heads, n_kv, dim = heads
    g = torch.Generator().manual_seed(1)
    meta = _step(order, [1, 5, 3, 40, 2, 1], pages=64)
    rows = meta.tokens.numel()
    q, k, v = (torch.randn(rows, h, dim, generator=g) for h in (n_heads, n_kv, n_kv))
    caches = [torch.randn(64, 4, n_kv, dim, generator=g) for _ in range(2)]
    step = TorchAttention().plan(meta, n_heads, n_kv, dim)
    assert step._pageable and len(step.fresh) == 2
    with torch.inference_mode():
        fused = step.attend(q, k, v, *(c.clone() for c in caches))
        with stored_layout():
            ref = TorchAttention().plan(meta, n_heads, n_kv, dim).attend(q, k, v, *(c.clone() for c in caches))
    assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_a_decoder_layer_in_one_call_equals_it_op_by_op(family, tmp_path):
    """On CPU a decode or verify step of up to 64 rows runs each decoder layer in one kernel call (``run_layer``):
    the same output and cache as the layer's ops, bf16 weights packed in bf16 included, q/k norms (Qwen3, Gemma 3),
    Gemma's offset and sandwich norms, its GELU and its windowed layer, and Mistral's window over every layer (a
    window of 5, which the 17-token steps pass); steps of more rows and trees, and layers the kernel does not
    implement (latent attention), run op by op."""
    from hf_models import save_random_model
    from mtp_train.models.checkpoint import load_transformer
    from mtp_train.models.transformer import DecoderLayer
    from mtp_train.runtime.attention import TorchAttention
    from mtp_train.runtime.small_batch import layer_weights, tune

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    if family in ("mistral", "gemma3_text"):
        sizes["sliding_window"] = 5
    if family == "gemma3_text":
        sizes["layer_types"] = ["sliding_attention", "full_attention"]
    save_random_model(family, tmp_path, **sizes)
    model = load_transformer(tmp_path)
    with torch.no_grad():  # layer 0's weights bf16 values (packed in bf16), layer 1's float32
        for p in model.layers[0].parameters():
            p.copy_(p.bfloat16().float())
        for p in model.parameters():  # norm weights away from their initial ones (Gemma's zeros, the others' ones)
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    if family == "llama":
        model.layers[1].attention_norm = torch.nn.Identity()  # an EAGLE layer's
    tune(model)
    assert (model.layers[1].decode_weights.attention_norm is None) == (family == "llama")
    assert all(layer.decode_weights is not None for layer in model.layers)
    assert model.layers[0].decode_weights.wqkv.dtype == torch.bfloat16
    assert model.layers[1].decode_weights.wqkv.dtype == torch.float32
    assert (model.layers[0].decode_weights.qkv_bias is not None) == (family == "qwen2")
    assert (model.layers[0].decode_weights.q_norm is not None) == (family in ("qwen3", "gemma3_text"))
    assert [w.decode_weights.window for w in model.layers] == ([5, 0] if family == "gemma3_text" else [0, 0])
    cfg = model.cfg
    for meta, layer in itertools.product((_step([7, 0, 12, 3], [1, 3, 2, 2]), _step([7, 0, 12, 3], [1, 9, 4, 3])),
                                         model.layers):  # 8 rows; 17, two chunks and a part of the kernel's
        plan = TorchAttention(cfg.sliding_window).plan(meta, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        cos_sin = (model.local_rope if layer.local else model.rope).cos_sin(meta.positions, torch.float32)
        x = torch.randn(meta.tokens.numel(), cfg.hidden_size)
        caches = [torch.randn(32, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
        one = [c.clone() for c in caches]
        with torch.inference_mode():
            fused = plan.run_layer(x, layer.decode_weights, cos_sin, one)
            weights, layer.decode_weights = layer.decode_weights, None
            ref = layer(x, cos_sin, plan, caches)
            layer.decode_weights = weights
        assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-4)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one, caches))
    wide = _step([7, 0], [1, 64], pages=64)
    assert TorchAttention().plan(wide, 4, 2, 16).run_layer(x, None, cos_sin, caches) is None, "65 rows: op by op"
    mla = ModelConfig.from_hf(__import__("hf_models").hf_config("deepseek_v3").to_dict())
    assert layer_weights(DecoderLayer(mla, model.tp)) is None, "latent attention: op by op"


@pytest.mark.parametrize("residual_normed", [False, True])
def test_an_eagle3_layer_in_one_call_equals_it_op_by_op(residual_normed, monkeypatch):
    """An EAGLE-3 head's layer, whose q/k/v read ``[norm(embeds) | norm(g)]`` (2H) with ``g`` (or its norm, speculators'
    ``norm_before_residual``) as the residual, runs in one kernel call at decode and verify sizes with the output and
    cache of its ops."""
    from mtp_train.heads import build_head, head_spec
    from mtp_train.heads.frozen import FrozenTarget
    from mtp_train.runtime import small_rows
    from mtp_train.runtime.attention import TorchAttention
    from mtp_train.runtime.small_batch import tune

    frozen = FrozenTarget.load(TINY_TARGET)
    torch.manual_seed(0)
    head = build_head(head_spec("eagle3", 1, frozen.cfg, "x", aux_layers=(1, 2, 3), draft_vocab=512,
                                norm_before_residual=residual_normed)).eval()
    tune(head)
    layer, cfg = head.layers[0], frozen.cfg
    calls = []
    kernel = small_rows.decode_layer
    monkeypatch.setattr(small_rows, "decode_layer", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    assert layer.decode_weights is not None and layer.decode_weights.wqkv.shape[1] == 2 * cfg.hidden_size
    for meta in (_step([7, 0, 12, 3], [1, 3, 2, 2]), _step([5], [1])):
        plan = TorchAttention().plan(meta, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        rows = meta.tokens.numel()
        embeds, hidden = torch.randn(rows, cfg.hidden_size), torch.randn(rows, cfg.hidden_size)
        caches = [torch.randn(32, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
        one = [c.clone() for c in caches]
        with torch.inference_mode():
            fused = head.run(embeds, hidden, meta.positions, plan, [one])
            weights, layer.decode_weights = layer.decode_weights, None
            ref = head.run(embeds, hidden, meta.positions, plan, [caches])
            layer.decode_weights = weights
        assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-4) and len(calls) == 1, "one kernel call, then none"
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one, caches))
        calls.clear()
    x = torch.randn(1, cfg.hidden_size)
    plan = TorchAttention().plan(_step([5], [1]), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert plan.run_layer(x, layer.decode_weights, head.rope.cos_sin(torch.tensor([5]), torch.float32), one) is None
