"""What one rank holds on its GPU in each stage, computed from the target's config and the recipe (``--dry-run``).

- **precompute / eval** (the runtime): this rank's share of the target's weights; activations of a
  ``precompute.batch_tokens`` scoring batch (estimated from the shapes: the residual stream and the captured
  layers, the fused QKV and gate/up projections, and the lm_head's chunk of logits); the KV cache, which takes
  what ``target.gpu_memory_fraction`` leaves (or ``target.kv_cache_gb``), told as token slots.
- **train**: the frozen embedding, final norm and lm_head (fp32); the head's weights and gradients (fp32) and
  AdamW's two moments, partitioned over the ranks under DeepSpeed ZeRO; the batch's features; the activations
  that autograd keeps for ``train.unroll`` steps over ``train.batch_tokens`` tokens, **measured** by running the
  head's forward on the meta device (no memory, no arithmetic) and counting what autograd saves, with attention
  keeping what a flash kernel keeps (linear in the tokens); and the chunked
  vocabulary loss's bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.heads import build_head, head_spec
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.runtime.engine import LOGITS_CHUNK
from mtp_train.train.loss import CHUNK_BYTES

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


def target_weight_bytes(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    """This rank's weights: the decoder layers split ``tp`` ways, the embedding and lm_head whole."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    heads = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_layers * layer // tp + heads + (2 * cfg.num_layers + 1) * h) * itemsize


def kv_bytes_per_token(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    return 2 * cfg.num_layers * (cfg.num_kv_heads // tp) * cfg.head_dim * itemsize


def scoring_activation_bytes(cfg: ModelConfig, recipe: Recipe, itemsize: int) -> int:
    """Peak activations of one scoring batch (an estimate from the shapes, per rank)."""
    tp, tokens = recipe.target.tp, recipe.precompute.batch_tokens
    h = cfg.hidden_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
    per_token = (4 + len(recipe.precompute.layers)) * h + 2 * qkv + 3 * cfg.intermediate_size // tp
    logits = 3 * LOGITS_CHUNK * cfg.vocab_size * 4  # fp32 logits, their log-softmax and the top-K's scratch
    return tokens * per_token * itemsize + logits


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


def head_activation_bytes_per_token(recipe: Recipe, cfg: ModelConfig) -> int:
    """Bytes autograd saves per token for one unrolled step of the head, counted on the meta device."""
    tokens = 1024
    spec = head_spec(recipe.head.kind, recipe.head.num_layers, cfg, "plan", recipe.head.convention)
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


def memory_plan(cfg: ModelConfig, recipe: Recipe, gpu_bytes: int = H100_BYTES) -> list[StagePlan]:
    """Each stage's bytes per rank on a GPU of ``gpu_bytes`` (an H100 80 GB by default)."""
    t = recipe.target
    itemsize = _dtype_bytes(t.dtype)
    weights = target_weight_bytes(cfg, t.tp, itemsize)
    scoring = scoring_activation_bytes(cfg, recipe, itemsize)
    kv = int(t.kv_cache_gb * GIB) if t.kv_cache_gb is not None else max(0, int(t.gpu_memory_fraction * gpu_bytes) - weights)
    slots = kv // kv_bytes_per_token(cfg, t.tp, itemsize)
    longest = recipe.data.max_length + (recipe.data.sampling.max_new_tokens if recipe.data.regenerate else 0)
    runtime_note = (f"KV {slots:,} token slots: a {recipe.precompute.batch_tokens:,}-token scoring batch "
                    f"{'fits' if slots >= recipe.precompute.batch_tokens else 'DOES NOT FIT'}, "
                    f"{slots // max(1, longest)} sequences of {longest:,} tokens at once")
    runtime = StagePlan("precompute/eval", {"weights": weights, "activations": scoring, "KV": kv}, gpu_bytes,
                        runtime_note)

    tr = recipe.train
    spec = head_spec(recipe.head.kind, recipe.head.num_layers, cfg, "plan", recipe.head.convention)
    with torch.device("meta"):
        head_params = sum(p.numel() for p in build_head(spec).parameters())
    zero = TRAIN_RANKS if tr.engine == "deepspeed" else 1
    grads = head_params * 4 // (zero if tr.engine == "deepspeed" and tr.zero_stage == 2 else 1)
    frozen = cfg.vocab_size * cfg.hidden_size * 4 * (1 if cfg.tie_word_embeddings else 2)
    features = tr.batch_tokens * (cfg.hidden_size * 4 + recipe.precompute.topk * 12 + 16)
    activations = tr.unroll * tr.batch_tokens * head_activation_bytes_per_token(recipe, cfg)
    train = StagePlan("train", {"frozen": frozen, "head+grads+AdamW": head_params * 4 + grads + head_params * 8 // zero,
                                "features": features, "activations": activations, "loss": 4 * CHUNK_BYTES},
                      gpu_bytes, f"{tr.unroll} unrolled steps x {tr.batch_tokens:,} tokens (fp32 activations"
                                 f"{'; bf16 autocast keeps less' if tr.mixed_precision == 'bf16' else ''}), AdamW over "
                                 f"{zero} rank(s)")
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
