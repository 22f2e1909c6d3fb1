"""What training a head holds per rank, measured from the module the trainer builds: its parameters and the
activations autograd saves, counted on the meta device (no memory, no arithmetic), with attention keeping what a
flash kernel keeps (an MLA head's attention: SDPA's math kernel, whose saved scores grow with the square of each
document's length). ``mtp_train.memory`` puts them into the stages' plans."""

from __future__ import annotations

import torch

from mtp_train.heads import build_head, head_spec
from mtp_train.heads.eagle3 import aux_layers_for
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.train.vocab import draft_vocab_size


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


def _plan_spec(recipe: Recipe, cfg: ModelConfig, kind: str | None = None):
    """The head of ``kind`` (the recipe's by default) the trainer would build for ``recipe`` (an eagle3 head's aux
    layers and draft vocabulary included)."""
    kind = kind or recipe.head.kind
    eagle3 = kind == "eagle3"
    return head_spec(kind, recipe.head.num_layers, cfg, "plan", recipe.head.convention,
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


def head_parameter_count(recipe: Recipe, cfg: ModelConfig, kind: str | None = None) -> int:
    """The head's parameters, counted on the meta device from the module the trainer builds: its decoder layer(s)
    of the target's attention (MLA for DeepSeek) with the MLP its ``HeadSpec`` asks for (the target's dense MLP of
    ``intermediate_size``, or its experts where ``head_spec`` sets ``moe``), plus the kind's own parts (``mtp``:
    enorm, hnorm, eh_proj, shared_head.norm)."""
    spec = _plan_spec(recipe, cfg, kind)
    with torch.device("meta"):
        return sum(p.numel() for p in build_head(spec).parameters())
