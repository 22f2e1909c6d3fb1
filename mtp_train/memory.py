"""What one rank holds on its GPU in each stage, computed from the target's config and the recipe (``--dry-run``).

- **precompute / eval** (the runtime): this rank's share of the target's weights (for DeepSeek: MLA's latent
  projections replicated and its heads split; every routed expert on every rank, sliced by channel; the router in
  float32); activations of a ``precompute.batch_tokens`` scoring batch (estimated from the shapes: the residual
  stream and the captured layers, the attention's projections, the MLP's or the experts', and the lm_head's chunk
  of logits); the KV cache, which takes what ``target.gpu_memory_fraction`` leaves (or ``target.kv_cache_gb``),
  told as token slots of the runtime's own pool (for MLA one latent per token and layer, on every rank).
- **train**: the frozen embedding, final norm and lm_head (fp32); the head's weights and gradients (fp32) and
  AdamW's two moments, partitioned over the ranks under DeepSpeed ZeRO; the batch's features; the activations
  that autograd keeps for ``train.unroll`` steps over ``train.batch_tokens`` tokens, **measured** by running the
  head's forward on the meta device (no memory, no arithmetic) and counting what autograd saves, with attention
  keeping what a flash kernel keeps (linear in the tokens; an MLA head's attention runs SDPA's math kernel, whose
  saved scores grow with the square of each document's length, bounded by ``data.max_length``); and the chunked
  vocabulary loss's bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.heads import build_head, head_spec
from mtp_train.heads.eagle3 import aux_layers_for
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.runtime.engine import LOGITS_CHUNK
from mtp_train.runtime.kv_cache import KVPool
from mtp_train.train.loss import CHUNK_BYTES
from mtp_train.train.vocab import draft_vocab_size
from mtp_train.features.layers import stored_layers

GIB = 2**30
H100_BYTES = 80 * 10**9  # an H100 80 GB reports about 79.1 GiB
TRAIN_RANKS = 8  # one 8xH100 node: ZeRO partitions the optimizer over this many ranks


@dataclass(frozen=True)
class StagePlan:
    """One stage's bytes per rank, by part, and whether they fit ``gpu_bytes``."""

    stage: str
    parts: dict[str, int]
    gpu_bytes: int
    note: str = ""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def line(self) -> str:
        parts = " + ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items())
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (f"  {self.stage:<16} {parts} = {self.total / GIB:.1f} GiB of {self.gpu_bytes / GIB:.1f}: {verdict}"
                + (f"; {self.note}" if self.note else ""))


def _dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2  # auto is bf16 on CUDA


def _mla_layer_elems(cfg: ModelConfig, tp: int) -> int:
    """One rank's latent-attention weights (``models/mla.py``): the query and ``kv_b``/``o`` projections of its
    ``num_heads / tp`` heads, and the latent projection ``wkv_a`` with its norms, which every rank holds whole."""
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads // tp
    assert m is not None
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * heads * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk
    latent = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    return q + latent + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h


def _moe_layer_elems(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """One rank's MoE weights (``models/moe.py``) as ``(elements in the model's dtype, float32 elements)``: all
    ``num_experts`` routed experts sliced by channel, the shared experts (a dense MLP of ``intermediate_size x
    num_shared_experts`` channels, sliced the same way), and the router (``[E, H]``, plus V3's correction bias),
    replicated and kept in float32."""
    moe, h = cfg.moe, cfg.hidden_size
    assert moe is not None
    experts = moe.num_experts * 3 * h * (moe.intermediate_size // tp)
    shared = 3 * h * (moe.intermediate_size * moe.num_shared_experts // tp)
    router = moe.num_experts * h + (moe.num_experts if moe.scoring == "sigmoid" else 0)
    return experts + shared, router


def target_weight_bytes(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    """This rank's weights: the decoder layers split ``tp`` ways, the embedding and lm_head whole.

    DeepSeek (MLA, MoE): exact per layer: what MLA replicates and what it splits (``_mla_layer_elems``); the first
    ``first_k_dense_replace`` layers' dense MLP, the others' experts, shared experts and float32 router
    (``_moe_layer_elems``)."""
    h = cfg.hidden_size
    heads = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    if cfg.mla is None and cfg.moe is None:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
        return (cfg.num_layers * layer // tp + heads + (2 * cfg.num_layers + 1) * h) * itemsize
    assert cfg.mla is not None, "a MoE target without MLA is not a family this runtime builds"
    elems, fp32 = heads + (2 * cfg.num_layers + 1) * h, 0
    for i in range(cfg.num_layers):
        elems += _mla_layer_elems(cfg, tp)
        if cfg.is_moe_layer(i):
            experts, router = _moe_layer_elems(cfg, tp)
            elems, fp32 = elems + experts, fp32 + router
        else:
            elems += 3 * h * (cfg.intermediate_size // tp)
    return elems * itemsize + fp32 * 4


def kv_bytes_per_token(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    """KV bytes one token takes on one rank: what the runtime's ``KVPool`` allocates per token slot. Llama
    families: K and V of ``num_kv_heads / tp`` heads per layer; MLA: one ``kv_lora_rank + qk_rope_head_dim``
    latent per layer, the same on every rank."""
    return KVPool.bytes_per_token(cfg, torch.float32 if itemsize == 4 else torch.bfloat16, tp)


def _mla_activation_elems(cfg: ModelConfig, tp: int) -> int:
    """Per token and rank, what ``LatentAttention.forward`` holds at once (its locals live to the end of the call):
    the query (and for a ``q_lora_rank`` its low-rank part and norm), ``wkv_a``'s output, the normed latent and its
    rotated key, the absorbed query ``q_nope W_UK`` and its concatenation with the rope part, the attention's output
    in latent space and after ``W_UV``. The absorbed form makes the per-head latent (``kv_lora_rank`` wide) the big
    term, not ``head_dim``."""
    m, heads = cfg.mla, cfg.num_heads // tp
    assert m is not None
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    per_head = m.qk_nope_head_dim + m.qk_rope_head_dim + 3 * m.kv_lora_rank + m.qk_rope_head_dim + m.v_head_dim
    return heads * per_head + 3 * latent + 2 * (m.q_lora_rank or 0)


def _moe_activation(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """Per token and rank, a MoE layer's ``(elements in the model's dtype, bytes of routing scratch)``: the shared
    experts' gate/up and product, the output accumulator, and one routed expert's batch bounded by every token
    (a token picks an expert at most once, so an expert's rows never exceed the batch: its gathered input,
    gate/up, product and output); the router's float32 input copy, logits, scores and choice, and the int64
    sort of the (token, choice) pairs with their float32 weights."""
    moe, h = cfg.moe, cfg.hidden_size
    assert moe is not None
    shared = 3 * (moe.intermediate_size * moe.num_shared_experts) // tp
    expert = 2 * h + 3 * moe.intermediate_size // tp
    routing = 4 * h + 3 * 4 * moe.num_experts + moe.experts_per_token * (4 * 8 + 2 * 4)
    return shared + h + expert, routing


def scoring_activation_bytes(cfg: ModelConfig, recipe: Recipe, itemsize: int) -> int:
    """Peak activations of one scoring batch (an estimate from the shapes, per rank).

    The attention's and the MLP's transients are summed (not maxed), as if both peaked at once. Llama families:
    the flash kernel's own scratch is small and not counted. DeepSeek: the attention term is MLA's absorbed form
    (``_mla_activation_elems``) in place of the fused QKV; the MLP term is the larger of the dense first layers'
    and a MoE layer's (``_moe_activation``, with the worst case that one expert takes every token); and the
    attention kernel's scratch is counted (``_mla_kernel_bytes``), since SDPA runs its math kernel for MLA's shapes."""
    tp, tokens = recipe.target.tp, recipe.precompute.batch_tokens
    h = cfg.hidden_size
    logits = 3 * LOGITS_CHUNK * cfg.vocab_size * 4  # fp32 logits, their log-softmax and the top-K's scratch
    if cfg.mla is None and cfg.moe is None:
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
        per_token = (4 + _stored(recipe, cfg)) * h + 2 * qkv + 3 * cfg.intermediate_size // tp
        return tokens * per_token * itemsize + logits
    attention = _mla_activation_elems(cfg, tp)
    dense = 3 * cfg.intermediate_size // tp if cfg.moe is None or cfg.moe.first_dense_layers > 0 else 0
    has_moe = cfg.moe is not None and cfg.num_layers > cfg.moe.first_dense_layers
    moe, routing = _moe_activation(cfg, tp) if has_moe else (0, 0)
    mlp_bytes = max(dense * itemsize, moe * itemsize + routing)
    per_token = ((4 + _stored(recipe, cfg)) * h + attention) * itemsize + mlp_bytes
    return tokens * per_token + logits + _mla_kernel_bytes(cfg, tp, min(recipe.data.max_length, tokens))


def _mla_kernel_bytes(cfg: ModelConfig, tp: int, longest: int) -> int:
    """SDPA's math kernel on one fresh sequence of ``longest`` tokens (the runtime attends one prefill at a time;
    scored sequences are cut to ``data.max_length``): float32 copies of the scaled query and of the key and value
    expanded to every head, the ``[heads, L, L]`` scores and their softmax. No fused kernel takes MLA's absorbed
    shapes (576-wide query and key heads, 512-wide values, one key head for all: FlashAttention stops at 256, the
    memory-efficient kernel takes no GQA); float32 as on CPU, where the math kernel upcasts bf16 (an overestimate
    if a GPU's math kernel stays in bf16)."""
    m, heads = cfg.mla, cfg.num_heads // tp
    assert m is not None
    key = m.kv_lora_rank + m.qk_rope_head_dim
    return heads * longest * (2 * key + m.kv_lora_rank) * 4 + 2 * heads * longest * longest * 4


class _FlashSaves(torch.autograd.Function):
    """Attention that keeps for backward what a flash kernel keeps: q, k, v, the output and the log-sum-exp
    (on the meta device SDPA falls back to the math kernel, which would also keep the whole score matrix)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:2], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError  # only ever run forward, to count what it saves


class _FlashLikeAttention:
    """The head's attention plan for counting (``attend(q [T, Hq, D], k, v [T, Hkv, D])``)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
        return _FlashSaves.apply(q, k, v)


def _stored(recipe: Recipe, cfg: ModelConfig) -> int:
    """Layers precompute captures per token (``precompute.layers``, and an eagle3 head's)."""
    return len(stored_layers(recipe, cfg))


def _plan_spec(recipe: Recipe, cfg: ModelConfig):
    """The head the trainer would build for ``recipe`` (an eagle3 head's aux layers and draft vocabulary included)."""
    eagle3 = recipe.head.kind == "eagle3"
    return head_spec(recipe.head.kind, recipe.head.num_layers, cfg, "plan", recipe.head.convention,
                     tuple(aux_layers_for(recipe.head.aux_layers, cfg)) if eagle3 else (),
                     draft_vocab_size(recipe.head.draft_vocab, cfg.vocab_size) if eagle3 else 0)


def head_activation_bytes_per_token(recipe: Recipe, cfg: ModelConfig) -> int:
    """Bytes autograd saves per token for one unrolled step of the head, counted on the meta device (for MLA the
    linear term of ``head_activation_terms``)."""
    if cfg.mla is not None:
        return head_activation_terms(recipe, cfg)[0]
    tokens = 1024
    spec = _plan_spec(recipe, cfg)
    with torch.device("meta"):
        head = build_head(spec)
        embeds, hidden = torch.empty(tokens, cfg.hidden_size), torch.empty(tokens, cfg.hidden_size)
        positions = torch.arange(tokens)
    params = {id(p) for p in head.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if id(t) not in params and id(t._base) not in params:
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head.run(embeds, hidden, positions, _FlashLikeAttention(), [(None, None)] * len(head.layers))
    return saved // tokens


def _balanced_bincount(ids: torch.Tensor, minlength: int = 0) -> torch.Tensor:
    """``torch.bincount`` for counting on the meta device, which has no kernel for it (and no values to route by):
    the (token, choice) pairs spread evenly over the experts. What autograd keeps does not depend on the spread
    (every pair saves the same; an expert's tensors are slices of shared ones), only on the number of pairs."""
    n = ids.numel()
    return torch.tensor([n // minlength + (e < n % minlength) for e in range(minlength)])


def mla_head_saved_bytes(recipe: Recipe, cfg: ModelConfig, cu_seqlens: list[int], device: str = "meta") -> int:
    """Bytes autograd keeps for one step of an MLA head over packed documents ``cu_seqlens``, with the attention
    the trainer runs (``DocumentCausalAttention``): the storages of the saved tensors still held when the forward
    ends, each once (a view shares its base's bytes; a temporary whose graph was dropped holds nothing). A head
    with experts (``HeadSpec.moe``) routes evenly on the meta device (``_balanced_bincount``)."""
    import contextlib
    import weakref
    from unittest import mock

    from mtp_train.heads.attention import DocumentCausalAttention

    tokens = cu_seqlens[-1]
    spec = _plan_spec(recipe, cfg)
    with torch.device(device):
        head = build_head(spec)
        embeds, hidden = torch.randn(tokens, cfg.hidden_size), torch.randn(tokens, cfg.hidden_size)
        positions = torch.cat([torch.arange(e - s) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    params = {p.untyped_storage()._cdata for p in head.parameters()}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    routing = mock.patch.object(torch, "bincount", _balanced_bincount) if device == "meta" else contextlib.nullcontext()
    with routing, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plan = DocumentCausalAttention(cu_seqlens)
        out = head.run(embeds, hidden, positions, plan, [(None, None)] * len(head.layers))
    kept: dict[int, int] = {}
    for ref in saved:
        t = ref()
        if t is not None and t.untyped_storage()._cdata not in params:
            kept[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    del out
    return sum(kept.values())


def head_activation_terms(recipe: Recipe, cfg: ModelConfig) -> tuple[int, int]:
    """What one unrolled step of the head keeps: ``(bytes per token, bytes per squared token of a document)``.

    Llama families: the second term is 0, attention keeping what a flash kernel keeps. MLA: SDPA has no fused
    kernel for the head's latent attention (one 576-wide key head shared by every query head, a 512-wide value:
    wider than FlashAttention's 256, and with GQA, which the memory-efficient kernel does not take; on CPU and
    meta it runs the math kernel), so the math kernel's saves are counted, measured on the meta device: the scaled
    query, the key and value expanded to every head, and each document's ``[heads, L, L]`` softmax. Measured at
    two lengths of one document, ``saved(L) = a L + b L^2`` gives both terms exactly. (If a GPU's SDPA does run
    a fused kernel for these shapes, the second term is an overestimate.)"""
    if cfg.mla is None:
        return head_activation_bytes_per_token(recipe, cfg), 0
    n = 512
    one, two = mla_head_saved_bytes(recipe, cfg, [0, n]), mla_head_saved_bytes(recipe, cfg, [0, 2 * n])
    quadratic = (two - 2 * one) // (2 * n * n)
    return (one - quadratic * n * n) // n, quadratic


def train_activation_bytes(recipe: Recipe, cfg: ModelConfig) -> int:
    """What autograd keeps for ``train.unroll`` steps over ``train.batch_tokens`` tokens; for MLA the documents'
    squared lengths are bounded by ``batch_tokens x`` the longest document (``data.max_length``):
    ``sum L_i^2 <= max L x sum L_i``."""
    tr = recipe.train
    linear, quadratic = head_activation_terms(recipe, cfg)
    longest = min(recipe.data.max_length, tr.batch_tokens)
    return tr.unroll * (tr.batch_tokens * linear + quadratic * tr.batch_tokens * longest)


def head_parameter_count(recipe: Recipe, cfg: ModelConfig) -> int:
    """The head's parameters, counted on the meta device from the module the trainer builds: its decoder layer(s)
    of the target's attention (MLA for DeepSeek) with the MLP its ``HeadSpec`` asks for (the target's dense MLP of
    ``intermediate_size``, or its experts where ``head_spec`` sets ``moe``), plus the kind's own parts (``mtp``:
    enorm, hnorm, eh_proj, shared_head.norm)."""
    spec = _plan_spec(recipe, cfg)
    with torch.device("meta"):
        return sum(p.numel() for p in build_head(spec).parameters())


def memory_plan(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int = H100_BYTES) -> list[StagePlan]:
    """Each stage's bytes per rank on a GPU of ``gpu_bytes`` (an H100 80 GB by default)."""
    t = recipe.target
    itemsize = _dtype_bytes(t.dtype)
    weights = target_weight_bytes(cfg, t.tp, itemsize)
    scoring = scoring_activation_bytes(cfg, recipe, itemsize)
    kv = int(t.kv_cache_gb * GIB) if t.kv_cache_gb is not None else max(0, int(t.gpu_memory_fraction * gpu_bytes) - weights)
    per_token = kv_bytes_per_token(cfg, t.tp, itemsize)
    slots = kv // per_token
    longest = recipe.data.max_length + (recipe.data.sampling.max_new_tokens if recipe.data.regenerate else 0)
    latent = (f" of {per_token:,} B (MLA latent {cfg.mla.kv_lora_rank}+{cfg.mla.qk_rope_head_dim} x "
              f"{cfg.num_layers} layers, on every rank)" if cfg.mla is not None else "")
    runtime_note = (f"KV {slots:,} token slots{latent}: a {recipe.precompute.batch_tokens:,}-token scoring batch "
                    f"{'fits' if slots >= recipe.precompute.batch_tokens else 'DOES NOT FIT'}, "
                    f"{slots // max(1, longest)} sequences of {longest:,} tokens at once")
    runtime = StagePlan("precompute/eval", {"weights": weights, "activations": scoring, "KV": kv}, gpu_bytes,
                        runtime_note)

    tr = recipe.train
    head_params = head_parameter_count(recipe, cfg)
    mla_scores = (f"; MLA attention scores of documents up to {min(recipe.data.max_length, tr.batch_tokens):,} "
                  "tokens" if cfg.mla is not None else "")
    zero = TRAIN_RANKS if tr.engine == "deepspeed" else 1
    grads = head_params * 4 // (zero if tr.engine == "deepspeed" and tr.zero_stage == 2 else 1)
    frozen = cfg.vocab_size * cfg.hidden_size * 4 * (1 if cfg.tie_word_embeddings else 2)
    layers = 4 if recipe.head.kind == "eagle3" else 1  # the last layer, and an eagle3 head's three (Batch.aux)
    features = tr.batch_tokens * (layers * cfg.hidden_size * 4 + recipe.precompute.topk * 12 + 16)
    activations = train_activation_bytes(recipe, cfg)
    train = StagePlan("train", {"frozen": frozen, "head+grads+AdamW": head_params * 4 + grads + head_params * 8 // zero,
                                "features": features, "activations": activations, "loss": 4 * CHUNK_BYTES},
                      gpu_bytes, f"{tr.unroll} unrolled steps x {tr.batch_tokens:,} tokens (fp32 activations"
                                 f"{'; bf16 autocast keeps less' if tr.mixed_precision == 'bf16' else ''}"
                                 f"{mla_scores}), AdamW over {zero} rank(s)")
    return [runtime, train]


def plan_lines(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int = H100_BYTES) -> list[str]:
    plans = memory_plan(cfg, recipe, gpu_bytes)
    return [f"memory per rank (GiB) on an {gpu_bytes / 10**9:.0f} GB GPU, from the target's config:"] + [
        p.line() for p in plans]


def main(argv: list[str] | None = None) -> int:
    """``python -m mtp_train.memory RECIPE.yaml [CONFIG.json]``: the plan, from the target's config.json or
    another (to plan before downloading the checkpoint; recipes/configs/ holds the shipped recipes' configs)."""
    import json
    import sys
    from pathlib import Path

    from mtp_train.recipe import load_recipe

    args = sys.argv[1:] if argv is None else argv
    recipe = load_recipe(Path(args[0]))
    config = Path(args[1]) if len(args) > 1 else recipe.target.path / "config.json"
    print("\n".join(plan_lines(ModelConfig.from_hf(json.loads(config.read_text()), str(config)), recipe)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
