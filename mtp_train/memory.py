"""What one rank holds on its GPU in each stage, computed from the target's config and the recipe (``--dry-run``,
which refuses a plan that does not fit, as training on a GPU does at its start: ``check_fits``).

- **precompute** (the runtime): this rank's share of the target's weights (for DeepSeek: MLA's latent
  projections replicated and its heads split; every routed expert on every rank, sliced by channel; the router in
  float32); activations of a ``precompute.batch_tokens`` scoring batch (estimated from the shapes: the residual
  stream and the captured layers, the attention's projections, the MLP's or the experts', and the lm_head's chunk
  of logits); the buffers the runtime reserves (``mtp_train.runtime.reserve``: FlashInfer's workspaces where its
  backend runs, NCCL's under TP); the KV cache, which takes what ``target.gpu_memory_fraction`` leaves beside them
  (or ``target.kv_cache_gb``), told as token slots of the runtime's own pool (for MLA one latent per token and
  layer, on every rank).
- **train**: the frozen embedding, final norm and lm_head (fp32), and the lm_head's bf16 copy under bf16; the head's
  weights and gradients (fp32) and AdamW's two moments, partitioned over the ranks under DeepSpeed ZeRO; the batch's
  features; the activations that autograd keeps for ``train.unroll`` steps over ``train.batch_tokens`` tokens (a
  dflash head: one checkpointed chunk of blocks), **measured** without memory or arithmetic in the dtype the
  trainer's autocast computes in (``mtp_train.head_memory.counting``), with the attention kernel the trainer runs
  on a GPU (``mtp_train.head_memory.attention_kernel``); and the loss: the labelled rows it gathers and
  keeps until backward, and the chunked vocabulary terms' bound. Online (``precompute.mode: online``) the train
  stage also holds the precompute stage's weights, scoring activations and buffers, and a KV cache for one scoring
  forward; precompute then holds nothing on the GPU unless it regenerates answers.
- **eval**: the precompute terms, the drafts' weights (whole, on the leader), the buffers of the engine's and each
  drafter's attention backend, and one KV budget that the target's pool shares with the drafts' pools
  (``mtp_train.eval.loading.kv_share``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from mtp_train.errors import UserError
from mtp_train.head_memory import (attention_kernel, autocast_dtype, batch_bytes, dflash_blocks, frozen_bytes,
                                   head_parameter_count, loss_copy_bytes, planned_steps, train_activation_bytes)
from mtp_train.heads.base import AUX_KINDS
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.runtime.engine import LOGITS_CHUNK
from mtp_train.runtime.kv_cache import KVPool
from mtp_train.runtime.reserve import reserved_bytes
from mtp_train.train.loss import CHUNK_BYTES
from mtp_train.features.layers import stored_layers

GIB = 2**30
# An H100 80 GB's memory as torch.cuda.mem_get_info reports it, the total the runtime applies
# target.gpu_memory_fraction to (kv_budget): one number for the plan and the runtime.
H100_BYTES = int(79.2 * 2**30)
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


def _stored(recipe: Recipe, cfg: ModelConfig) -> int:
    """Layers precompute captures per token (``precompute.layers``, and an eagle3 head's)."""
    return len(stored_layers(recipe, cfg))


def flashinfer_backends(recipe: Recipe, cfg: ModelConfig, engines: int) -> int:
    """How many of ``engines`` attention backends are FlashInfer's on a GPU, each with its workspace: all where
    ``target.attention_backend`` is auto or flashinfer, the target is half (auto: bf16 on CUDA) and has no MLA
    (``mtp_train.runtime.attention.backend_name``: FlashInfer has no float32 kernels and no MLA); else none."""
    t = recipe.target
    return engines if t.attention_backend != "torch" and t.dtype != "float32" and cfg.mla is None else 0


def _kv_budget(recipe: Recipe, gpu_bytes: int, held: int) -> int:
    """The KV cache's bytes: ``target.kv_cache_gb``, or what ``target.gpu_memory_fraction`` of the GPU leaves beside
    ``held`` (the weights, and the buffers the runtime reserves before it sizes its cache)."""
    t = recipe.target
    return int(t.kv_cache_gb * GIB) if t.kv_cache_gb is not None else max(0, int(t.gpu_memory_fraction * gpu_bytes) - held)


def eval_plan(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int, scoring: int) -> StagePlan:
    """The eval's bytes on the leader rank: the target's share of the weights, the drafts' weights (whole: the
    leader holds them), activations, the buffers of one attention backend for the engine and one per drafter, and
    one KV budget that the target's pool shares with the drafts' pools (each holds a slot for every slot of the
    target's; ``mtp_train.eval.loading.kv_share``)."""
    t = recipe.target
    itemsize = _dtype_bytes(t.dtype)
    weights = target_weight_bytes(cfg, t.tp, itemsize)
    kinds = recipe.eval_head_kinds()
    heads = sum(head_parameter_count(recipe, cfg, kind) for kind in kinds) * itemsize
    drafters = len(kinds) + (recipe.eval.draft_model is not None)
    buffers = reserved_bytes(flashinfer_backends(recipe, cfg, 1 + drafters), t.tp)
    kv = _kv_budget(recipe, gpu_bytes, weights + heads + buffers)
    target_slot = kv_bytes_per_token(cfg, t.tp, itemsize)
    draft_slots = sum(kv_bytes_per_token(dataclasses.replace(cfg, num_layers=recipe.head.num_layers), 1, itemsize)
                      for kind in kinds)
    slots = kv // (target_slot + draft_slots)
    note = (f"KV {slots:,} token slots, shared by the target and {len(kinds)} head(s) ({', '.join(kinds) or 'none'}): "
            f"{slots // max(1, recipe.eval.batch_size):,} per sequence of a batch of {recipe.eval.batch_size}")
    parts = {"weights": weights, "heads": heads, "activations": scoring} | _nonzero(buffers=buffers) | {"KV": kv}
    return StagePlan("eval", parts, gpu_bytes, note)


def _nonzero(**parts: int) -> dict[str, int]:
    return {name: size for name, size in parts.items() if size}


def _precompute_plan(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int, scoring: int) -> StagePlan:
    """The runtime scoring (and regenerating): the target's share of the weights, a scoring batch's activations,
    one attention backend's buffers (and NCCL's under TP), and the KV cache in what is left."""
    t = recipe.target
    itemsize = _dtype_bytes(t.dtype)
    weights = target_weight_bytes(cfg, t.tp, itemsize)
    buffers = reserved_bytes(flashinfer_backends(recipe, cfg, 1), t.tp)
    kv = _kv_budget(recipe, gpu_bytes, weights + buffers)
    per_token = kv_bytes_per_token(cfg, t.tp, itemsize)
    slots = kv // per_token
    longest = recipe.data.max_length + (recipe.data.sampling.max_new_tokens if recipe.data.regenerate else 0)
    latent = (f" of {per_token:,} B (MLA latent {cfg.mla.kv_lora_rank}+{cfg.mla.qk_rope_head_dim} x "
              f"{cfg.num_layers} layers, on every rank)" if cfg.mla is not None else "")
    note = (f"KV {slots:,} token slots{latent}: a {recipe.precompute.batch_tokens:,}-token scoring batch "
            f"{'fits' if slots >= recipe.precompute.batch_tokens else 'DOES NOT FIT'}, "
            f"{slots // max(1, longest)} sequences of {longest:,} tokens at once")
    parts = {"weights": weights, "activations": scoring} | _nonzero(buffers=buffers) | {"KV": kv}
    return StagePlan("precompute", parts, gpu_bytes, note)


def _train_plan(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int, scoring: int) -> StagePlan:
    """The trainer's bytes per rank (the module docstring's **train**); online, the target beside the head."""
    t, tr = recipe.target, recipe.train
    head_params = head_parameter_count(recipe, cfg)
    kernel = attention_kernel(recipe, cfg)
    scores = (f"; the {kernel} attention kernel" + (f"'s scores of documents up to "
              f"{min(recipe.data.max_length, tr.batch_tokens):,} tokens" if kernel == "math" else ""))
    zero = TRAIN_RANKS if tr.engine == "deepspeed" else 1
    grads = head_params * 4 // (zero if tr.engine == "deepspeed" and tr.zero_stage == 2 else 1)
    bf16 = autocast_dtype(recipe) is not None  # auto: bf16 on a GPU; the trainer's autocast is bf16's only
    frozen = frozen_bytes(cfg, half_lm_head=bf16)
    features = batch_bytes(recipe, cfg, 4 if recipe.head.kind in AUX_KINDS else 1)  # last layer (+ aux)
    parts = {"frozen": frozen, "head+grads+AdamW": head_params * 4 + grads + head_params * 8 // zero,
             "features": features, "activations": train_activation_bytes(recipe, cfg),
             "loss": loss_copy_bytes(recipe, cfg) + 4 * CHUNK_BYTES}
    note = (f"{_steps(recipe)} ({'bf16 autocast' if bf16 else 'fp32'} activations{scores}), AdamW over {zero} "
            f"rank(s){'; the lm_head also in bf16' if bf16 else ''}")
    if recipe.precompute.mode == "online":  # the target beside the head, its KV sized for one scoring forward
        itemsize = _dtype_bytes(t.dtype)
        online_kv = 2 * recipe.precompute.batch_tokens * kv_bytes_per_token(cfg, t.tp, itemsize)
        parts |= {"target": target_weight_bytes(cfg, t.tp, itemsize), "scoring": scoring,
                  **_nonzero(buffers=reserved_bytes(flashinfer_backends(recipe, cfg, 1), t.tp)), "KV": online_kv}
        note += (f"; online: the target (TP {t.tp}) scores beside the head, KV for one "
                 f"{recipe.precompute.batch_tokens:,}-token forward (at most 2x its tokens in slots)")
    if tr.tau_every:  # rank 0's τ probe: the whole target, its KV for the probe's prompts and answers
        itemsize = _dtype_bytes(t.dtype)
        probe_kv = tr.tau_prompts * (recipe.data.max_length + tr.tau_tokens + 64) * kv_bytes_per_token(cfg, 1, itemsize)
        parts |= {"tau probe": target_weight_bytes(cfg, 1, itemsize) + 2 * probe_kv}
        note += "; train.tau_every: the whole target on rank 0 for the τ probe"
    return StagePlan("train", parts, gpu_bytes, note)


def _steps(recipe: Recipe) -> str:
    """What the activations are of: unrolled steps, or a dflash head's blocks and their chunks."""
    tokens, parallel = recipe.train.batch_tokens, recipe.head.kind == "eagle3" and recipe.head.parallel_drafts
    if recipe.head.kind != "dflash":
        return f"{planned_steps(recipe)} {'P-EAGLE draft' if parallel else 'unrolled'} steps x {tokens:,} tokens"
    blocks, rows = dflash_blocks(recipe)
    which = ("every anchor" if not recipe.train.anchors else f"{blocks:,} anchors ({recipe.train.anchors} per "
             f"document of {min(recipe.data.max_length, tokens):,} tokens)")
    return f"blocks of {recipe.head.block_size} at {which} of {tokens:,} tokens, {rows:,} block rows at a time"


def memory_plan(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int = H100_BYTES) -> list[StagePlan]:
    """Each stage's bytes per rank on a GPU of ``gpu_bytes`` (an H100 80 GB by default)."""
    scoring = scoring_activation_bytes(cfg, recipe, _dtype_bytes(recipe.target.dtype))
    runtime = _precompute_plan(cfg, recipe, gpu_bytes, scoring)
    if recipe.precompute.mode == "online" and not recipe.data.regenerate:  # it only plans the shards
        runtime = StagePlan("precompute", {}, gpu_bytes, "online: the rows' tokens and the shard plan, no target")
    elif recipe.precompute.mode == "online":
        runtime = dataclasses.replace(runtime, note=runtime.note + "; online: the target regenerates answers only")
    return [runtime, _train_plan(cfg, recipe, gpu_bytes, scoring), eval_plan(cfg, recipe, gpu_bytes, scoring)]


def plan_lines(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int = H100_BYTES) -> list[str]:
    plans = memory_plan(cfg, recipe, gpu_bytes)
    return [f"memory per rank (GiB) of {gpu_bytes / GIB:.1f} GiB (an H100 80 GB), from the target's config:"] + [
        p.line() for p in plans]


def check_fits(cfg: ModelConfig, recipe: Recipe, stages: list[str], gpu_bytes: int = H100_BYTES,
               gpu: str = "an H100 80 GB") -> None:
    """Refuse, in one line naming the stage and what would fit (``_what_fits``), the first of ``stages`` whose plan
    needs more than ``gpu_bytes`` per rank."""
    for plan in memory_plan(cfg, recipe, gpu_bytes):
        if plan.stage in stages and not plan.fits:
            fixes = _what_fits(cfg, recipe, plan.stage, gpu_bytes)
            raise UserError(
                f"{plan.stage}: the memory plan needs {plan.total / GIB:.1f} GiB per rank, more than the "
                f"{gpu_bytes / GIB:.1f} GiB of {gpu}; "
                + (f"it fits with {', or '.join(fixes)}" if fixes else "no higher target.tp or fewer batch tokens fit")
                + " (`python -m mtp_train.memory RECIPE` prints the plan by part)")


def _what_fits(cfg: ModelConfig, recipe: Recipe, stage: str, gpu_bytes: int) -> list[str]:
    """For each setting that moves ``stage``'s plan, its first value that fits, planned again, with its total: a
    higher ``target.tp`` (a divisor of the attention and KV heads) where the stage holds the target; half the
    ``train.batch_tokens`` (doubling ``train.grad_accum``, so that a step trains as many tokens), then a quarter...;
    the same of ``precompute.batch_tokens`` where the stage scores; ``precompute.mode: offline`` for online
    training; no τ probe (``train.tau_every: 0``)."""
    def changed(section: str, **update) -> Recipe:
        return recipe.model_copy(update={section: getattr(recipe, section).model_copy(update=update)})

    tr, pc, tp = recipe.train, recipe.precompute, recipe.target.tp
    online = pc.mode == "online"
    holds_target, heads = stage != "train" or online, math.gcd(cfg.num_heads, cfg.num_kv_heads)
    halvings = [2**i for i in range(1, 8)]
    knobs = [
        [(f"target.tp={d}", changed("target", tp=d)) for d in range(tp + 1, heads + 1) if heads % d == 0]
        if holds_target else [],
        [(f"train.batch_tokens={tr.batch_tokens // f} train.grad_accum={tr.grad_accum * f}",
          changed("train", batch_tokens=tr.batch_tokens // f, grad_accum=tr.grad_accum * f))
         for f in halvings if tr.batch_tokens // f >= 256] if stage == "train" else [],
        [(f"precompute.batch_tokens={pc.batch_tokens // f}", changed("precompute", batch_tokens=pc.batch_tokens // f))
         for f in halvings if pc.batch_tokens // f >= 256] if holds_target else [],
        [("precompute.mode=offline", changed("precompute", mode="offline"))] if stage == "train" and online else [],
        [("train.tau_every=0", changed("train", tau_every=0))] if stage == "train" and tr.tau_every else [],
    ]
    found = []
    for tries in knobs:
        for label, candidate in tries:
            plan = next(p for p in memory_plan(cfg, candidate, gpu_bytes) if p.stage == stage)
            if plan.fits:
                found.append(f"{label} ({plan.total / GIB:.1f} GiB)")
                break
    return found


def main(argv: list[str] | None = None) -> int:
    """``python -m mtp_train.memory RECIPE.yaml [CONFIG.json] [key=value ...]``: the plan, from the target's
    config.json or another (to plan before downloading the checkpoint; recipes/configs/ holds the shipped recipes'
    configs), with the recipe's fields overridden as the CLI does."""
    import json
    import sys
    from pathlib import Path

    from mtp_train.recipe import load_recipe

    args = sys.argv[1:] if argv is None else argv
    overrides, paths = [a for a in args if "=" in a], [a for a in args if "=" not in a]
    recipe = load_recipe(Path(paths[0]), overrides)
    config = Path(paths[1]) if len(paths) > 1 else recipe.target.path / "config.json"
    print("\n".join(plan_lines(ModelConfig.from_hf(json.loads(config.read_text()), str(config)), recipe)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
