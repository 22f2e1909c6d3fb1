"""Attention over paged KV behind one interface: plan once per step, then write and attend per layer.

``torch`` (the CPU default) gathers the pages of sequences with as many new tokens, and a similar cached
length, into a padded batch and calls SDPA with a causal mask offset by the cached length. ``flashinfer`` (CUDA)
uses FlashInfer's paged prefill wrapper and ``append_paged_kv_cache``; it lives in ``flashinfer_backend.py``
and is imported only when selected.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from mtp_train.models.parts import decode_copies
from mtp_train.models.transformer import AttentionPlan
from mtp_train.runtime.batch import BatchMetadata
from mtp_train.runtime import small_rows
from mtp_train.runtime.device import to_device
from mtp_train.runtime.small_rows import LayerWeights
from mtp_train.runtime.window_attention import WindowChunk, window_plan, windowed_attention


class AttentionBackend(Protocol):
    """Plans each step's attention; the plan (``models.transformer.AttentionPlan``) serves every layer."""

    def plan(self, meta: BatchMetadata, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool = True
             ) -> AttentionPlan:
        """``causal=False``: each new token sees every key of its sequence up to the sequence's last new one
        (a DFlash block)."""
        ...


class _Group:
    """Sequences with the same number of new tokens ``Q``, attended in one padded SDPA call.

    ``rows`` are their new tokens' rows in the packed batch: a slice when the sequences are neighbours there
    (a step of decodes alone), else a ``[G*Q]`` index; ``kv_pages [G, P]`` the cache pages of their keys, in order
    (``P`` pages hold the group's longest; page 0 stands in past a sequence's last page), so keys are read a whole
    page at a time; ``mask [G, 1, Q, P*page_size]`` lets query i of sequence g (absolute position
    ``kv_len - Q + i``) see keys at positions ``<= its own`` (a sliding window is ``window_attention``'s); not
    ``causal``, every query sees every key up to ``kv_len``; in a tree (``meta.tree``), the keys its bits name.
    """

    def __init__(self, meta: BatchMetadata, seqs: list[int], q_len: int, bounds: list[int], host_kv_lens: list[int],
                 causal: bool = True) -> None:
        dev = meta.tokens.device
        index = to_device(torch.tensor(seqs), dev)
        kv_lens = meta.kv_lens.long()[index]
        self.q_len = q_len
        self.rows: torch.Tensor | slice
        if (rows := _neighbour_rows(seqs, bounds)) is not None:
            self.rows = rows
        else:
            starts = meta.qo_indptr.long()[index]
            self.rows = (starts[:, None] + torch.arange(q_len, device=dev)[None, :]).view(-1)
        size = meta.page_size
        num_pages = -(-max(host_kv_lens[b] for b in seqs) // size)
        page = torch.arange(num_pages, device=dev)
        first_page = meta.page_indptr.long()[index]
        page_valid = page[None, :] < (kv_lens[:, None] + size - 1) // size
        where = (first_page[:, None] + page[None, :]).clamp(max=max(0, meta.page_indices.numel() - 1))
        self.kv_pages = torch.where(page_valid, meta.page_indices.long()[where], 0)  # [G, P]
        key_pos = torch.arange(num_pages * size, device=dev)
        key_valid = key_pos[None, :] < kv_lens[:, None]
        q_pos = kv_lens[:, None] - q_len + torch.arange(q_len, device=dev)[None, :]  # [G, Q]
        if not causal:
            q_pos = (kv_lens[:, None] - 1).expand(-1, q_len)
        mask = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])
        if meta.tree is not None:  # a tree: the context, then each query's ancestors and itself
            for row, b in enumerate(seqs):
                start, bits = meta.tree.prefix[b], meta.tree.bits[b]
                mask[row, :, start:] = False
                mask[row, :, start : start + bits.shape[1]] = bits
        # Additive float mask, built once per step rather than converted from bool in every layer.
        self.mask = torch.zeros(mask.shape, device=dev).masked_fill_(~mask, float("-inf"))[:, None]


def _neighbour_rows(seqs: list[int], bounds: list[int]) -> slice | None:
    """The new tokens' rows of the sequences ``seqs`` (ascending) as one slice of the packed batch (``bounds``: its
    ``qo_indptr``) where they are neighbours there, else None."""
    return slice(bounds[seqs[0]], bounds[seqs[-1] + 1]) if seqs[-1] - seqs[0] == len(seqs) - 1 else None


# A padded group's longest cached length is at most RATIO times its shortest, plus SLACK tokens.
RATIO, SLACK = 1.5, 64


def _similar_lengths(seqs: list[int], kv_lens: list[int]) -> list[list[int]]:
    """``seqs`` (ascending) cut into runs of similar cached length, each ascending, so that padding every sequence of
    a run to its longest wastes little: decodes of 40 and 1,500 cached tokens are not padded to 1,500 together."""
    runs: list[list[int]] = []
    for b in sorted(seqs, key=kv_lens.__getitem__):
        if runs and kv_lens[b] <= RATIO * kv_lens[runs[-1][0]] + SLACK:
            runs[-1].append(b)
        else:
            runs.append([b])
    return [sorted(run) for run in runs]


class TorchStep:
    """SDPA over the pages, split so that no sequence is padded to another's length.

    - A fresh prefill (nothing cached before, full attention) reads no pages: it runs causal SDPA
      on its own new K/V, with no padding and no mask.
    - The other sequences are grouped by their number of new tokens (decodes together, verifies of
      one k together); each group is one SDPA call over its pages (``_Group``).

    A mixed step (many decodes and one long prefill) thus costs what its parts cost, where padding
    every decode to the prefill's length cost more than the step's matmuls. With a sliding window (a Mistral
    target's, or a draft head's ``head.window``) every sequence is ``window_attention``'s instead: each query reads
    its window's keys only.
    """

    def __init__(self, meta: BatchMetadata, sliding_window: int | None, causal: bool = True) -> None:
        bounds, kv_lens = meta.host_qo_indptr.tolist(), meta.host_kv_lens.tolist()  # (the host's copies)
        self.meta, self.sliding_window, self.causal = meta, sliding_window, causal
        self.window_meta: BatchMetadata | None = None  # the windowed layers' own pages, where a pool is split (Gemma 3)
        self.slot_mapping = meta.slot_mapping
        self.num_tokens = bounds[-1]
        self.fresh: list[tuple[int, int]] = []  # token ranges of fresh prefills
        self._by_len: dict[int, list[int]] = {}
        for b, kv_len in enumerate(kv_lens if sliding_window is None else ()):  # (a window: window_attention's)
            q_len = bounds[b + 1] - bounds[b]
            if q_len == kv_len and meta.tree is None:
                self.fresh.append((bounds[b], bounds[b + 1]))
            else:
                self._by_len.setdefault(q_len, []).append(b)
        self._groups: list[_Group] | None = None
        # the step's layers may run as one kernel call each (``run_layer``): a decode or verify of few rows on CPU
        self._one_call = (self.num_tokens <= small_rows.MAX_ROWS and causal and meta.tree is None
                          and meta.tokens.device.type == "cpu" and small_rows.kernel() is not None)
        self._indexes: dict[bool, tuple[torch.Tensor, ...]] = {}  # run_layer's, for global and windowed layers
        # the sequences with keys in the cache may be attended by one kernel call in place of padded groups (CPU)
        self._pageable = bool(self._by_len and causal and sliding_window is None and meta.tree is None
                              and meta.tokens.device.type == "cpu" and small_rows.kernel() is not None)
        self._paged: tuple[torch.Tensor | slice, tuple[torch.Tensor, ...]] | None = None
        self._window_chunks: dict[int, list[WindowChunk]] = {}

    @property
    def paged(self) -> tuple[torch.Tensor | slice, tuple[torch.Tensor, ...]]:
        """The rows of the sequences that are not fresh prefills (a slice where they are neighbours, else an index)
        and ``small_rows.attend_paged``'s indexes for them (built on first use, as ``groups``)."""
        if self._paged is None:
            bounds, kv_lens = self.meta.host_qo_indptr.tolist(), self.meta.host_kv_lens.tolist()
            seqs = sorted(b for group in self._by_len.values() for b in group)
            q_start = [0]
            for b in seqs:
                q_start.append(q_start[-1] + bounds[b + 1] - bounds[b])
            rows = _neighbour_rows(seqs, bounds)
            if rows is None:
                rows = torch.cat([torch.arange(bounds[b], bounds[b + 1]) for b in seqs])
            page_start = self.meta.host_page_indptr.long()[seqs + [len(kv_lens)]]
            self._paged = rows, (torch.tensor(q_start), torch.tensor([kv_lens[b] for b in seqs]), page_start,
                                 self.meta.page_indices.long())
        return self._paged

    def window_chunks(self, window: int) -> list[WindowChunk]:
        """Under a sliding ``window``: the step's query chunks, their keys' slots and masks (built once per window,
        for every layer)."""
        if window not in self._window_chunks:
            self._window_chunks[window] = window_plan(self.window_meta or self.meta, window, self.causal)
        return self._window_chunks[window]

    @property
    def groups(self) -> list[_Group]:
        """The padded SDPA groups (built on first use: a step whose layers all run in one call needs none)."""
        if self._groups is None:
            bounds, kv_lens = self.meta.host_qo_indptr.tolist(), self.meta.host_kv_lens.tolist()
            self._groups = [_Group(self.meta, run, q_len, bounds, kv_lens, self.causal)
                            for q_len, seqs in self._by_len.items() for run in _similar_lengths(seqs, kv_lens)]
        return self._groups

    def run_layer(self, x: torch.Tensor, weights: LayerWeights, cos_sin: tuple[torch.Tensor, torch.Tensor],
                  kv: tuple[torch.Tensor, torch.Tensor], attention_input: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
        """A decoder layer over this step's rows ``x [T, H]`` in one call of ``decode_layer.cpp`` (its weights packed
        by ``runtime/small_batch.py``) -> ``[T, H]``; None where this step or these tensors are not for it (the
        layer then runs op by op). ``attention_input [T, 2H]``: an EAGLE-3 layer's normed input (``x`` its
        residual), which its q/k/v projection reads."""
        if not self._one_call or x.requires_grad or x.dtype != torch.float32 or kv[0].dtype != torch.float32:
            return None
        if (x if attention_input is None else attention_input).shape[1] != weights.wqkv.shape[1]:
            return None  # (an EAGLE-3 layer called without its input)
        windowed = bool(weights.window) and self.window_meta is not None  # (its own pages: KVPool)
        if windowed not in self._indexes:
            meta = self.window_meta if windowed else self.meta
            self._indexes[windowed] = (meta.slot_mapping, meta.host_qo_indptr.long(), meta.host_kv_lens.long(),
                                       meta.host_page_indptr.long(), meta.page_indices.long())
        return small_rows.decode_layer(x.contiguous(), weights, *cos_sin, *kv, *self._indexes[windowed],
                                       window=self.sliding_window or 0,
                                       attention_input=None if attention_input is None else attention_input.contiguous())

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq, D]``, after writing ``k``/``v`` to the cache;
        ``window``: this layer's own sliding window (Gemma 3's windowed layers, their cache on ``window_meta``'s pages
        where it is set), else the plan's."""
        self.write(k, v, k_cache, v_cache, window is not None)
        if (window := window or self.sliding_window) is not None:
            flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
            return windowed_attention(q, self.window_chunks(window),
                                      lambda slots: (flat_k.index_select(0, slots), flat_v.index_select(0, slots)))
        paged = None
        if self._pageable and q.dtype == k_cache.dtype == torch.float32 and not q.requires_grad and decode_copies():
            rows, indexes = self.paged
            paged = rows, lambda q_rows: small_rows.attend_paged(q_rows, k_cache, v_cache, *indexes, q.shape[-1] ** -0.5)
        return self._attend(q, k, v, lambda pages: (k_cache.index_select(0, pages), v_cache.index_select(0, pages)),
                            paged=paged)

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              windowed: bool = False) -> None:
        """Store ``k``/``v [T, Hkv, D]`` at the step's token slots (``windowed``: a windowed layer's, on
        ``window_meta``'s pages where it is set), attending nothing (a DFlash context)."""
        slots = self.window_meta.slot_mapping if windowed and self.window_meta is not None else self.slot_mapping
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

    def attend_latent(
        self, q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, v_dim: int, scale: float
    ) -> torch.Tensor:
        """MLA in the absorbed form: ``q [T, H, D]`` against one shared ``latent [T, 1, D]`` per token, whose first
        ``v_dim`` channels are also the value -> ``[T, H, v_dim]``, after writing ``latent`` to the cache."""
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, self.slot_mapping, latent.to(cache.dtype))
        if self.sliding_window is not None:
            def slots(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                g = flat.index_select(0, s)
                return g, g[..., :v_dim]

            return windowed_attention(q, self.window_chunks(self.sliding_window), slots, scale)

        def gather(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            g = cache.index_select(0, pages)
            return g, g[..., :v_dim]

        return self._attend(q, latent, latent[..., :v_dim], gather, scale)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gather, scale: float | None = None,
                paged: tuple[torch.Tensor | slice, Callable[[torch.Tensor], torch.Tensor]] | None = None
                ) -> torch.Tensor:
        """SDPA of ``q [T, Hq, D]``: fresh prefills on this step's ``k``/``v [T, Hkv, D|Dv]``, the groups on what
        ``gather(pages [N])`` reads from the cache (``[N, page_size, Hkv, D]`` and ``[N, page_size, Hkv, Dv]``)
        -> ``[T, Hq, Dv]``; with ``paged`` (the groups' rows, and the kernel that attends their queries over the
        pages), one kernel call in place of the groups."""
        gqa = k.shape[1] != q.shape[1]
        parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
        for s, e in self.fresh:
            # 4-D [1, H, L, D] inputs take SDPA's fused CPU kernel; 3-D ones do not.
            out = F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2), v[None, s:e].transpose(1, 2),
                is_causal=self.causal, enable_gqa=gqa, scale=scale,
            )
            parts.append((slice(s, e), out[0].transpose(0, 1)))
        if paged is not None:
            rows, kernel = paged
            q_p = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
            parts.append((rows, kernel(q_p).view(-1, *q.shape[1:])))
        for g in self.groups if paged is None else ():
            q_g = q[g.rows] if isinstance(g.rows, slice) else q.index_select(0, g.rows)
            # Whole pages by index_select: about twice as fast as token slots, several times advanced indexing.
            k_g, v_g = gather(g.kv_pages.view(-1))
            groups, keys = g.kv_pages.shape[0], g.mask.shape[-1]
            k_g = k_g.view(groups, keys, *k_g.shape[2:])  # [G, L, Hkv, D]
            v_g = v_g.reshape(groups, keys, *v_g.shape[2:])
            out = F.scaled_dot_product_attention(
                q_g.view(-1, g.q_len, *q.shape[1:]).transpose(1, 2), k_g.transpose(1, 2).to(q.dtype),
                v_g.transpose(1, 2).to(q.dtype), attn_mask=g.mask.to(q.dtype), enable_gqa=gqa, scale=scale,
            )
            parts.append((g.rows, out.transpose(1, 2).reshape(-1, q.shape[1], v.shape[-1])))
        if len(parts) == 1 and parts[0][1].shape[0] == self.num_tokens:
            return parts[0][1]
        out = q.new_empty((*q.shape[:2], v.shape[-1]))
        for where, part in parts:
            if isinstance(where, slice):
                out[where] = part
            else:
                out.index_copy_(0, where, part)
        return out


class TorchAttention:
    """The portable backend; runs anywhere torch runs."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def plan(self, meta: BatchMetadata, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool = True
             ) -> TorchStep:
        return TorchStep(meta, self.sliding_window, causal)


def _flashinfer_installed() -> bool:
    import importlib.util

    if importlib.util.find_spec("flashinfer") is not None:
        return True
    _notice("runtime: flashinfer is not installed, so attention on CUDA uses the torch backend "
            "(pip install -e '.[gpu]' for flashinfer)")
    return False


_noticed: set[str] = set()


def _notice(line: str) -> None:
    """``line`` on stderr, once per process."""
    if line not in _noticed:
        _noticed.add(line)
        print(line, file=sys.stderr)


def check_latent(name: str, torch_only: str | None) -> None:
    """``backend_name``'s refusal that the recipe (``target.attention_backend``) and the target's config
    (``torch_only``: ``ModelConfig.torch_only``) decide alone, which ``mtp_train.pipeline.check_recipe`` makes before
    any stage runs."""
    from mtp_train.errors import UserError

    if torch_only and name == "flashinfer":
        raise UserError(f"target.attention_backend: flashinfer is not wired for {torch_only} targets in this "
                        "runtime; use torch or auto")


def backend_name(name: str, device: torch.device, dtype: torch.dtype, torch_only: str | None = None,
                 head_dim: int | None = None, sliding_window: int | None = None) -> str:
    """Which backend ``name`` (the recipe's ``target.attention_backend``: auto, torch or flashinfer) resolves to.

    ``auto`` picks flashinfer on CUDA in bf16/fp16 when it is installed (the ``gpu`` extra), and torch otherwise.
    FlashInfer has no float32 kernels: fp32 on CUDA takes the torch backend, with a notice when flashinfer was asked
    for by name. ``torch_only``: what of the model only the torch backend implements (``ModelConfig.torch_only``:
    MLA's paged latent attention, Gemma 3's per-layer windows), or None.
    With ``head_dim``, flashinfer's kernels for it are built or loaded now (``flashinfer_backend.load_kernels``);
    where they cannot be (a node without nvcc and no prebuilt kernels), ``auto`` takes the torch backend with a
    notice and ``flashinfer`` is refused.
    """
    from mtp_train.errors import UserError

    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(name)
    if torch_only:
        check_latent(name, torch_only)
        return "torch"
    if name == "flashinfer" and device.type != "cuda":
        raise UserError("target.attention_backend: flashinfer needs a CUDA device; use torch or auto on CPU")
    if name != "torch" and device.type == "cuda" and dtype == torch.float32:
        if name == "flashinfer":
            _notice("runtime: flashinfer has no float32 kernels; attention in float32 uses the torch backend "
                    "(set target.dtype: bfloat16 for flashinfer)")
        return "torch"
    if name == "auto" and not (device.type == "cuda" and _flashinfer_installed()):
        return "torch"
    if name == "torch" or head_dim is None:
        return name if name != "auto" else "flashinfer"
    why = _kernels_missing(device, dtype, head_dim, sliding_window)
    if why is None:
        return "flashinfer"
    if name == "flashinfer":
        raise UserError(f"target.attention_backend: flashinfer could not build its kernels ({why}); put CUDA's nvcc "
                        "on this node's PATH (or CUDA_HOME), carry prebuilt kernels (bench/flashinfer_aot.sh), or use "
                        "auto or torch")
    _notice(f"runtime: flashinfer could not build its kernels ({why}), so attention uses the torch backend")
    return "torch"


def _kernels_missing(device: torch.device, dtype: torch.dtype, head_dim: int, sliding_window: int | None
                     ) -> str | None:
    """None when flashinfer's kernels for these shapes load, else why not, in one line."""
    from mtp_train.runtime.flashinfer_backend import load_kernels

    try:
        load_kernels(device, dtype, head_dim, sliding_window)
    except Exception as e:  # noqa: BLE001  (nvcc missing, a compile error, a prebuilt module that does not load)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"
    return None


def select_backend(
    name: str, device: torch.device, sliding_window: int | None, dtype: torch.dtype = torch.float32,
    torch_only: str | None = None, head_dim: int | None = None,
) -> AttentionBackend:
    """The attention backend that ``name`` resolves to (:func:`backend_name`), built for ``device``; with
    ``head_dim``, flashinfer only where its kernels for it load."""
    if backend_name(name, device, dtype, torch_only, head_dim, sliding_window) == "torch":
        return TorchAttention(sliding_window)
    from mtp_train.runtime.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(device, sliding_window, dtype)
