"""What training a head holds per rank, measured from the module the trainer builds: its parameters and the
activations autograd saves, counted without memory or arithmetic (``counting``: the meta device in fp32; under bf16
autocast, the plan's default on a GPU, fake CPU tensors that CPU autocast casts), with the attention kernel the
trainer runs on a GPU (``attention_kernel``: a flash kernel keeps no scores; SDPA's math kernel keeps each document's,
which grow with the square of its length; ``range_attention``'s chunks keep none, their scores bounded per chunk);
and the loss's gathered rows. ``mtp_train.memory`` puts them into the plans."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtp_train.heads import AUX_KINDS, build_head, head_spec
from mtp_train.heads.attention import ATTENTION_PEAK_BYTES
from mtp_train.heads.eagle3 import aux_layers_for
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import Recipe
from mtp_train.train.blocks import block_chunk_rows, planned_anchors
from mtp_train.train.vocab import draft_vocab_size


class _FlashSaves(torch.autograd.Function):
    """Attention that keeps for backward what a flash kernel keeps: q, k, v, the output and the log-sum-exp
    (on the meta device SDPA falls back to the math kernel, which would also keep the whole score matrix)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape[1], q.shape[0], q.shape[2]).transpose(0, 1)  # SDPA's layout: the reshape copies
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
    h, eagle3 = recipe.head, kind == "eagle3"
    return head_spec(kind, h.num_layers, cfg, "plan", h.convention,
                     tuple(aux_layers_for(h.aux_layers, cfg)) if kind in AUX_KINDS else (),
                     draft_vocab_size(h.draft_vocab, cfg.vocab_size) if eagle3 else 0, h.block_size,
                     h.mask_id(cfg.vocab_size), h.fc_norm, h.norm_output, h.parallel_drafts or 0, h.window or 0,
                     h.norm_before_fc, h.norm_before_residual)


def autocast_dtype(recipe: Recipe) -> torch.dtype | None:
    """The dtype the trainer's autocast computes the head in on a GPU (``train.mixed_precision``: ``auto`` is bf16
    on CUDA; the trainer's only autocast is bf16's), or None: fp32."""
    return torch.bfloat16 if recipe.train.mixed_precision in ("auto", "bf16") else None


@contextlib.contextmanager
def counting(half: torch.dtype | None, device: str = "meta") -> Iterator[str]:
    """Where the plan's forwards run, yielding the device to build on. fp32: ``device`` (``meta`` by default: no
    memory, no arithmetic; ``cpu`` for the tests' real forwards). Under ``half`` autocast, CPU autocast, which casts
    what a GPU's does for the head's ops (linear, matmul and SDPA in half; the norms take fp32 statistics
    themselves); the meta device has no autocast, so the tensors are fake CPU ones (no memory, no arithmetic)
    unless ``device`` is ``cpu``."""
    fake = (FakeTensorMode(allow_non_fake_inputs=True) if half is not None and device == "meta"
            else contextlib.nullcontext())
    cast = torch.autocast("cpu", dtype=half) if half is not None else contextlib.nullcontext()
    with fake, cast:
        yield "cpu" if half is not None else device


def saved_storages(params: list[torch.Tensor]) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], int]]:
    """A ``saved_tensors_hooks`` pack hook and the bytes of what it saw that is still held: each storage once (a
    view shares its base's bytes; a temporary whose graph was dropped holds nothing), ``params``' storages left out
    (what the model or the batch holds anyway)."""
    skip = {t.untyped_storage()._cdata for t in params}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    def held() -> int:
        kept = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (r() for r in saved)
                if t is not None and t.untyped_storage()._cdata not in skip}
        return sum(kept.values())

    return pack, held


def head_activation_bytes_per_token(recipe: Recipe, cfg: ModelConfig) -> int:
    """Bytes autograd saves per token for one unrolled step of the head with a flash kernel's attention: the
    difference of two lengths, which leaves out what does not grow with them (autocast's half copies of the
    head's weights: ``autocast_weight_bytes``)."""
    n = 1024
    one, two = (head_saved_bytes(recipe, cfg, [0, m * n], flash=True) for m in (1, 2))
    return (two - one) // n


def autocast_weight_bytes(recipe: Recipe, cfg: ModelConfig) -> int:
    """What autocast keeps beside the activations: its half copy of each of the head's weights, made once per
    autocast region and saved for backward (the trainer's region spans the unrolled steps)."""
    return 2 * head_parameter_count(recipe, cfg) if autocast_dtype(recipe) is not None else 0


def _balanced_bincount(ids: torch.Tensor, minlength: int = 0) -> torch.Tensor:
    """``torch.bincount`` for counting without values (meta or fake tensors: none to route by): the (token, choice)
    pairs spread evenly over the experts, as a real host tensor. What autograd keeps does not depend on the spread
    (every pair saves the same; an expert's tensors are slices of shared ones), only on the number of pairs."""
    n = ids.numel()
    with unset_fake_temporarily():
        return torch.tensor([n // minlength + (e < n % minlength) for e in range(minlength)], device="cpu")


def attention_kernel(recipe: Recipe, cfg: ModelConfig, kind: str | None = None) -> str:
    """The kernel the head's training attention runs on a GPU. ``chunked``: ``range_attention`` (an MLA head's
    576-wide key, eagle3's training-time test, dflash's blocks: shapes and masks no fused SDPA kernel takes), which
    keeps q, k and v and makes one chunk's scores at a time. Otherwise SDPA as torch picks it: ``flash`` when the
    compute dtype is half (``train.mixed_precision`` bf16 or fp16, or ``auto``, which is bf16 on CUDA) and the head
    dimension is at most 256; else ``math`` (fp32 training), which keeps each document's scores."""
    kind = kind or recipe.head.kind
    if cfg.mla is not None or kind in ("eagle3", "dflash"):
        return "chunked"
    half = recipe.train.mixed_precision in ("auto", "bf16", "fp16")
    return "flash" if half and cfg.head_dim <= 256 else "math"


def head_saved_bytes(recipe: Recipe, cfg: ModelConfig, cu_seqlens: list[int], steps: int = 1,
                     device: str = "meta", anchors: list[torch.Tensor] | None = None, flash: bool = False) -> int:
    """Bytes autograd keeps for ``steps`` chained steps of the head over packed documents ``cu_seqlens``, with the
    attention the trainer runs (SDPA's math kernel for ``DocumentCausalAttention``'s, or with ``flash`` what a flash
    kernel keeps, ``_FlashLikeAttention``; ``range_attention`` for MLA's,
    eagle3's ``TTTAttention``, whose keys grow by a step each time, and dflash's ``BlockAttention``, at ``anchors``:
    per document, every position by default), in the dtype the trainer's autocast computes in (``counting``): the
    storages of the saved tensors still held when the forward ends (``saved_storages``; the aux states are the
    batch's, not counted here; autocast's half copies of the weights are, a constant ``head_activation_terms``
    leaves out). A dflash head is one forward of blocks over its context, what one checkpointed chunk of
    ``block_loss`` keeps. A head with experts (``HeadSpec.moe``) routes evenly where no values are computed
    (``_balanced_bincount``)."""
    from unittest import mock

    from mtp_train.heads.attention import DocumentCausalAttention
    from mtp_train.train.blocks import BlockAttention
    from mtp_train.train.ttt import TTTAttention

    tokens = cu_seqlens[-1]
    spec = _plan_spec(recipe, cfg)
    eagle3, dflash = spec.kind == "eagle3", spec.kind == "dflash"
    if anchors is None:  # on the host, where the block plan reads them
        anchors = [torch.arange(e - s - 1) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]  # every one
    half = autocast_dtype(recipe)
    fake = device == "meta"
    routing = mock.patch.object(torch, "bincount", _balanced_bincount) if fake else contextlib.nullcontext()
    with counting(half, device) as device, routing, torch.device(device):
        head = build_head(spec)
        embeds, hidden = torch.randn(tokens, cfg.hidden_size), torch.randn(tokens, cfg.hidden_size)
        aux = torch.randn(tokens, len(spec.aux_layers) * cfg.hidden_size) if eagle3 or dflash else None
        positions = torch.cat([torch.arange(e - s) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
        for module in head.modules():  # experts in a loop on every device: torch's grouped matmul takes bf16 weights
            if hasattr(module, "no_grouped_mm"):  # only (meta and CUDA), and the head's master weights are fp32
                module.no_grouped_mm = True
        # the parameters, and the aux states, which the batch holds (the plan's features term counts them)
        pack, held = saved_storages([*head.parameters(), *([aux] if aux is not None else [])])
        with sdpa_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            plan = TTTAttention(cu_seqlens, spec.window) if eagle3 else None
            for step in range(steps):
                if dflash:  # one forward drafts the whole block: every step at once
                    firsts = embeds[: sum(a.numel() for a in anchors)]
                    blocks = torch.cat(anchors).to(device)[:, None] + torch.arange(spec.block_size, device=device)
                    out = hidden = head(firsts, aux, positions, blocks.view(-1),
                                        BlockAttention(cu_seqlens, anchors, spec.block_size, None, spec.window))
                    break
                if eagle3:
                    out = head(embeds, hidden if step else None, positions + step, plan, None if step else aux)
                    hidden = head.feedback_state(out)
                else:
                    attention = _FlashLikeAttention() if flash else DocumentCausalAttention(cu_seqlens, spec.window)
                    out = head.run(embeds, hidden, positions, attention, [(None, None)] * len(head.layers))
                    hidden = head.feedback_state(out)
        saved = held()
        del out, hidden
    return saved


def planned_steps(recipe: Recipe) -> int:
    """Steps of rows per token the plan counts: ``train.unroll``, or a P-EAGLE head's ``parallel_drafts`` (its first
    step and a mask row per further draft at every anchor, each attending as a chained step's row does: counted as
    that many chained steps)."""
    return (recipe.head.parallel_drafts or recipe.train.unroll) if recipe.head.kind == "eagle3" else recipe.train.unroll


def head_activation_terms(recipe: Recipe, cfg: ModelConfig) -> tuple[int, int]:
    """What the ``train.unroll`` steps of the head keep: ``(bytes per token, bytes per squared token of a
    document)``, for the kernel ``attention_kernel`` names (a dflash head: ``dflash_activation_terms``), in the
    dtype the trainer's autocast computes in (``counting``).

    ``flash``: the second term is 0, attention keeping what a flash kernel keeps (q, k, v, output, log-sum-exp).
    ``chunked``: the second term is 0 too, ``range_attention`` keeping q, k and v.
    ``math``: the kernel's saves are counted too: the scaled query, the key and value expanded to every head, and
    each document's ``[heads, L, S]`` softmax. Measured over the unrolled steps at three lengths of one document,
    ``saved(L) = c + a L + b L^2`` gives both terms exactly, without the constant ``c`` (autocast's half copies of
    the weights: ``autocast_weight_bytes``)."""
    steps = planned_steps(recipe)
    kernel = attention_kernel(recipe, cfg)
    if kernel == "flash":
        return steps * head_activation_bytes_per_token(recipe, cfg), 0
    n = 512
    # eagle3's steps differ (its keys grow): all are measured. Other heads' steps are alike: one, times unroll.
    measured, times = (steps, 1) if recipe.head.kind == "eagle3" else (1, steps)
    one, two = (head_saved_bytes(recipe, cfg, [0, m * n], measured) for m in (1, 2))
    if kernel == "chunked":
        return times * (two - one) // n, 0
    three = head_saved_bytes(recipe, cfg, [0, 3 * n], measured)
    quadratic = (three - 2 * two + one) // (2 * n * n)
    return times * ((two - one - 3 * quadratic * n * n) // n), times * quadratic


def dflash_activation_terms(recipe: Recipe, cfg: ModelConfig) -> tuple[int, int]:
    """What one forward of a dflash head keeps: ``(bytes per context row, bytes per block row)``, at two context
    lengths and two numbers of anchors (``saved = c0 + c n + b A B``, linear in both: each block row's scores are
    made a chunk at a time, not kept; ``c0``: autocast's half copies of the weights, left out)."""
    n, size = 512, recipe.head.block_size
    every = head_saved_bytes(recipe, cfg, [0, n])  # n - 1 anchors
    half = head_saved_bytes(recipe, cfg, [0, n], anchors=[torch.arange((n - 1) // 2)])
    longer = head_saved_bytes(recipe, cfg, [0, 2 * n])  # 2n - 1 anchors
    per_block_row = (every - half) // ((n - 1 - (n - 1) // 2) * size)
    return (longer - every - per_block_row * n * size) // n, per_block_row


def dflash_blocks(recipe: Recipe) -> tuple[int, int]:
    """``(blocks a batch trains as the plan counts them, block rows per checkpointed chunk)``: ``block_loss``'s."""
    tr, d = recipe.train, recipe.data
    return (planned_anchors(tr.batch_tokens, d.max_length, tr.anchors),
            block_chunk_rows(tr.batch_tokens, d.max_length, tr.anchors, recipe.head.block_size))


def loss_copy_bytes(recipe: Recipe, cfg: ModelConfig) -> int:
    """What the loss keeps beside the head's activations, over ``train.unroll`` steps of ``train.batch_tokens``
    rows: the rows with a label, gathered (``x[mask]``) and kept until backward. Per row and step: five rows of
    the hidden width (smooth-L1's fed-back state and hidden target; the lm_head's norm keeps its input and its
    normalised rows; the vocabulary chunks' checkpoint keeps the norm's output), the teacher's rows (``exact``:
    the target's hidden; top-K: log-probs, ids and the tail), and the row's index, mask and per-row terms (24 B).
    eagle3 has no hidden term but gathers twice: the counted rows, then those its draft vocabulary holds. dflash:
    per block position of the blocks ``dflash_blocks`` counts. mtp and eagle also keep, from the second step on,
    the previous step's output gathered as the step's hidden input, and a post-norm head the batch's hidden through
    the target's final norm. Under bf16 autocast the rows are still counted at fp32 width, a bound: an mtp head's
    normed output is fp32 (the norm's fp32 weight), others' are bf16. The vocabulary chunks' own working set is the
    separate ``4 x CHUNK_BYTES`` bound."""
    tr = recipe.train
    hidden = cfg.hidden_size * 4
    teacher = hidden if tr.teacher == "exact" else recipe.precompute.topk * 12 + 4
    if recipe.head.kind == "dflash":  # per block position: the gathered output, its norm, the teacher's rows
        return (recipe.head.block_size - 1) * dflash_blocks(recipe)[0] * (3 * hidden + teacher + 24)
    if recipe.head.kind == "eagle3":
        row, whole = 2 * hidden + 2 * teacher + 24, 0
    else:  # and from the second step on, the previous step's output gathered as the step's hidden input
        row = 5 * hidden + teacher + 24
        whole = tr.batch_tokens * hidden * (planned_steps(recipe) - 1)
        whole += tr.batch_tokens * hidden if _plan_spec(recipe, cfg).hidden_input == "post_norm" else 0
    return planned_steps(recipe) * tr.batch_tokens * row + whole


def train_activation_bytes(recipe: Recipe, cfg: ModelConfig) -> int:
    """What autograd keeps for ``train.unroll`` steps over ``train.batch_tokens`` tokens; with the math kernel the
    documents' squared lengths are bounded by ``batch_tokens x`` the longest document (``data.max_length``):
    ``sum L_i^2 <= max L x sum L_i``. ``chunked``: plus one chunk's scores at their peak (``ATTENTION_PEAK_BYTES``).
    dflash: one checkpointed chunk of blocks at a time, over a context of at most the batch's tokens. Under bf16
    autocast, also its half copies of the head's weights (``autocast_weight_bytes``)."""
    tr = recipe.train
    if recipe.head.kind == "dflash":
        per_context_row, per_block_row = dflash_activation_terms(recipe, cfg)
        blocks, rows = dflash_blocks(recipe)
        rows = min(rows, blocks * recipe.head.block_size)
        weights = autocast_weight_bytes(recipe, cfg)
        return tr.batch_tokens * per_context_row + rows * per_block_row + ATTENTION_PEAK_BYTES + weights
    linear, quadratic = head_activation_terms(recipe, cfg)
    longest = min(recipe.data.max_length, tr.batch_tokens)
    peak = ATTENTION_PEAK_BYTES if attention_kernel(recipe, cfg) == "chunked" else 0
    return tr.batch_tokens * linear + quadratic * tr.batch_tokens * longest + peak + autocast_weight_bytes(recipe, cfg)


def frozen_bytes(cfg: ModelConfig, half_lm_head: bool = False) -> int:
    """The frozen embedding and lm_head the trainer holds in fp32 (one tensor when tied), and with ``half_lm_head``
    the lm_head's bf16 copy that bf16 autocast computes the logits with (``FrozenTarget.half_lm_head``)."""
    return cfg.vocab_size * cfg.hidden_size * (4 * (1 if cfg.tie_word_embeddings else 2) + (2 if half_lm_head else 0))


def batch_bytes(recipe: Recipe, cfg: ModelConfig, layers: int) -> int:
    """One training batch of ``train.batch_tokens`` tokens with ``layers`` hidden layers in fp32, the top-K
    teacher (fp32 log-probs and int64 ids) and the token, mask and tail per token."""
    return recipe.train.batch_tokens * (layers * cfg.hidden_size * 4 + recipe.precompute.topk * 12 + 16)


def head_parameter_count(recipe: Recipe, cfg: ModelConfig, kind: str | None = None) -> int:
    """The head's parameters, counted on the meta device from the module the trainer builds: its decoder layer(s)
    of the target's attention (MLA for DeepSeek) with the MLP its ``HeadSpec`` asks for (the target's dense MLP of
    ``intermediate_size``, or its experts where ``head_spec`` sets ``moe``), plus the kind's own parts (``mtp``:
    enorm, hnorm, eh_proj, shared_head.norm)."""
    spec = _plan_spec(recipe, cfg, kind)
    with torch.device("meta"):
        return sum(p.numel() for p in build_head(spec).parameters())
