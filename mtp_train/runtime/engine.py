"""The inference engine: ``generate()`` with continuous batching and ``score()`` for teacher-forced features.

One decode step, top to bottom: ``Scheduler.schedule()`` picks the sequences and their new
tokens -> ``build_batch()`` packs them into flat metadata -> the backend ``plan()``s the
step's attention -> ``Transformer.forward()`` writes K/V into the pages and returns hidden
states -> ``logits()`` at each sequence's last token -> ``sample()`` -> ``Sequence.append()``
-> finished sequences free their pages.

Entry points: ``generate()`` and ``score()``; ``step()`` (one continuous-batching step on a scheduler that
``start()`` and ``submit()`` fill); ``forward()`` (one packed batch of scheduled sequences, whose pages the
scheduler or ``reserve()`` reserved).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.models.checkpoint import load_transformer
from mtp_train.models.parts import stored_layout
from mtp_train.models.tp import TensorParallel
from mtp_train.recipe import TargetConfig
from mtp_train.models.transformer import Transformer
from mtp_train.models.config import ModelConfig
from mtp_train.runtime.attention import backend_name, select_backend
from mtp_train.runtime.batch import BatchMetadata, TreeMask, build_batch
from mtp_train.runtime.host_memory import keep_freed_memory
from mtp_train.runtime.kv_cache import KVPool, OutOfPages, PageAllocator, SplitAllocator, window_pool_pages
from mtp_train.runtime.reserve import reserved_bytes
from mtp_train.runtime.sampling import SamplingParams, sample
from mtp_train.runtime.scheduler import Scheduler
from mtp_train.runtime.sequence import RequestStats, Sequence, Status
from mtp_train.runtime.small_batch import tune

LOGITS_CHUNK = 2048  # tokens per lm_head call in score(), so [chunk, vocab] stays small
CPU_KV_BYTES = 512 * 2**20  # the KV budget on CPU when the recipe sets none


def kv_budget(target: TargetConfig, device: torch.device, reserved: int = 0) -> int:
    """Bytes for the target's KV cache on this rank: ``target.kv_cache_gb`` when set; else on CUDA what
    ``target.gpu_memory_fraction`` of the GPU leaves beside what is in use now (call it once the weights are
    loaded) and ``reserved``, what is allocated later (``runtime.reserve``: attention workspaces, NCCL's buffers);
    else ``CPU_KV_BYTES``."""
    if target.kv_cache_gb is not None:
        return int(target.kv_cache_gb * 2**30)
    if device.type != "cuda":
        return CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    budget = int(target.gpu_memory_fraction * total) - (total - free) - reserved
    if budget <= 0:
        raise UserError(f"target.gpu_memory_fraction: {target.gpu_memory_fraction} of {total / 2**30:.1f} GiB leaves no "
                        f"room for the KV cache beside the {(total - free) / 2**30:.1f} GiB in use after loading the "
                        f"weights and the {reserved / 2**30:.1f} GiB reserved for workspaces and NCCL; raise it, set "
                        "target.kv_cache_gb, or use more tensor-parallel ranks (target.tp)")
    return budget


def reserved_for(target: TargetConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp_size: int,
                 drafters: int = 0) -> int:
    """``runtime.reserve.reserved_bytes`` for this rank's engine and ``drafters`` drafters with attention: one
    FlashInfer workspace each where the backend resolves to flashinfer, and NCCL's buffers under tensor parallelism."""
    flashinfer = backend_name(target.attention_backend, device, dtype, cfg.torch_only, cfg.head_dim,
                              cfg.sliding_window) == "flashinfer"
    return reserved_bytes((1 + drafters) if flashinfer else 0, tp_size)


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: RequestStats


@dataclass
class ScoreOutput:
    """Teacher-forced features of packed sequences (``T`` tokens, ``S`` sequences, ``L`` layers), on the CPU.

    - ``cu_seqlens [S+1]`` int64 offsets of the sequences;
    - ``hidden [T, L, H]``: outputs of the requested layers; the last layer is taken **before** the final norm (in
      the model's dtype, or as ``score``'s ``store_hidden`` made each batch of them: bf16, or e4m3 values);
    - ``topk_logprobs [T, K]`` float32 and ``topk_ids [T, K]`` int64: the target's top-K next-token log-probs;
    - ``logsumexp [T]`` float32: log-sum-exp of the full logits, so the probabilities are recoverable;
    - ``tail_logprob [T]`` float32: log of the probability mass outside the top-K, computed exactly from the
      full logits (``-inf`` where K covers the vocabulary; ``0`` when K = 0);
    - ``hidden_scale [T, L]`` float32: each row's scale where ``store_hidden`` gave one (FP8), else None.
    """

    cu_seqlens: torch.Tensor
    hidden: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    logsumexp: torch.Tensor
    tail_logprob: torch.Tensor
    layers: list[int] = field(default_factory=list)
    hidden_scale: torch.Tensor | None = None


def default_stop_ids(root: Path) -> tuple[int, ...]:
    """End-of-sequence ids from ``generation_config.json``, else ``config.json``."""
    for name in ("generation_config.json", "config.json"):
        path = root / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def _allocator(cfg: ModelConfig, num_pages: int, page_size: int, max_seqs: int, max_batch_tokens: int
               ) -> PageAllocator:
    """The target's pages: one pool for every layer; or, where some layers have a window and some none (Gemma 3), a
    ``SplitAllocator`` whose windowed pool takes what ``window_pool_pages`` says of the ``num_pages`` an unsplit
    pool would have, its global pool the rest of their bytes."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    windowed = sum(w is not None for w in windows)
    if not cfg.layer_windows or windowed in (0, cfg.num_layers):
        return PageAllocator(num_pages, page_size)
    window = max(w for w in windows if w is not None)
    window_pages = window_pool_pages(num_pages, page_size, window, max_seqs, max_batch_tokens)
    global_pages = num_pages + (num_pages - window_pages) * windowed // (cfg.num_layers - windowed)
    return SplitAllocator(global_pages, page_size, window_pages, window)


class Engine:
    def __init__(
        self,
        model: Transformer,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_bytes: int = CPU_KV_BYTES,
        max_batch_tokens: int = 8192,
        max_seqs: int = 256,
        backend: str = "auto",
        stop_ids: tuple[int, ...] = (),
        small_batch_layout: bool = True,
    ) -> None:
        """``small_batch_layout``: on CPU, measure which weights multiply faster from a packed (or transposed)
        copy at decode sizes and keep those copies (``runtime/small_batch.py``)."""
        self.model = model
        self.cfg = model.cfg
        self.tp: TensorParallel = model.tp
        self.device = model.output.weight.device
        dtype = model.output.weight.dtype
        if num_pages is None:
            # Every rank of a tensor-parallel group sizes the same pool: their schedulers must agree step for step
            # (a rank that ran out of pages alone would stop joining the group's collectives), while each measured
            # its own free memory, and only the leader holds the drafts.
            num_pages = self.tp.agree_min(KVPool.pages_for_budget(self.cfg, page_size, kv_bytes, dtype, self.tp.size),
                                          self.device)
        self.allocator = _allocator(self.cfg, num_pages, page_size, max_seqs, max_batch_tokens)
        self.kv = KVPool(self.cfg, self.allocator, dtype, self.device, self.tp.size)
        self.backend_name = backend  # as the recipe asked (auto, torch, flashinfer): drafters follow it
        self.backend = select_backend(backend, self.device, self.cfg.sliding_window, dtype,
                                      torch_only=self.cfg.torch_only, head_dim=self.cfg.head_dim)
        self.small_batch_layout = small_batch_layout and self.device.type == "cpu"  # drafters follow it
        if self.device.type == "cpu":
            keep_freed_memory()
        self.small_batch = tune(model) if self.small_batch_layout else {}
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.stop_ids = stop_ids

    @classmethod
    def from_pretrained(
        cls,
        root: Path | str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel = TensorParallel(),
        **kwargs,
    ) -> Engine:
        root = Path(root)
        model = load_transformer(root, dtype=dtype, device=device, tp=tp)
        return cls(model, stop_ids=default_stop_ids(root), **kwargs)

    @classmethod
    def for_target(cls, target: TargetConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel,
                   **kwargs) -> Engine:
        """The recipe's target on ``device``: its attention backend, and a KV cache sized by ``kv_budget`` once
        the weights are loaded."""
        root = Path(target.path)
        model = load_transformer(root, dtype=dtype, device=device, tp=tp)
        device = torch.device(device)
        reserved = reserved_for(target, model.cfg, dtype, device, tp.size)
        return cls(model, stop_ids=default_stop_ids(root), backend=target.attention_backend,
                   kv_bytes=kv_budget(target, device, reserved), **kwargs)

    # -- one forward -------------------------------------------------------------------------------------

    def reserve(self, scheduled: list[tuple[Sequence, list[int]]]) -> None:
        """Reserve pages for each sequence's new tokens; raises ``OutOfPages`` before touching any when short."""
        if not self.allocator.can_reserve([(seq.pages, len(new)) for seq, new in scheduled]):
            need = sum(self.allocator.pages_needed(seq.pages, len(new)) for seq, new in scheduled)
            raise OutOfPages(f"need {need} pages, {self.allocator.num_free} free (or too few windowed pages)")
        for seq, new in scheduled:
            self.allocator.reserve(seq.pages, len(new))

    def forward(
        self, scheduled: list[tuple[Sequence, list[int]]], capture: list[int] = (),
        positions: torch.Tensor | None = None, tree: TreeMask | None = None,
    ) -> tuple[BatchMetadata, torch.Tensor, list[torch.Tensor]]:
        """Forward each sequence's new tokens (prefill, decode or verify), whose pages are reserved; a tree's
        verify gives their ``positions`` and ``tree`` mask (``build_batch``).

        Returns the packed batch, the pre-norm hidden states ``[T, H]`` and the outputs of the ``capture`` layers.
        """
        new = [new for _, new in scheduled]
        cached = [seq.cached - len(n) for seq, n in scheduled]
        size = self.allocator.page_size
        meta = build_batch(new, cached, [seq.pages.pages for seq, _ in scheduled], size, self.device, positions, tree)
        cfg = self.cfg
        plan = self.backend.plan(meta, cfg.num_heads // self.tp.size, cfg.num_kv_heads // self.tp.size, cfg.head_dim)
        if isinstance(self.allocator, SplitAllocator):  # the windowed layers' slots (a torch plan: see KVPool)
            plan.window_meta = build_batch(new, cached, [seq.pages.window.pages for seq, _ in scheduled], size,
                                           self.device, meta.positions, tree)
        hidden, captured = self.model(meta.tokens, meta.positions, plan, self.kv.layers, capture)
        return meta, hidden, captured

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)

    # -- generate ----------------------------------------------------------------------------------------

    def start(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        draft_allocator: PageAllocator | None = None,
    ) -> tuple[Scheduler, list[Sequence]]:
        """Queue the requests; ``draft_allocator`` holds a speculative draft's pages, freed with the target's."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        scheduler = Scheduler(self.allocator, self.max_batch_tokens, self.max_seqs, draft_allocator)
        return scheduler, [self.submit(scheduler, i, prompt, p) for i, (prompt, p) in
                           enumerate(zip(prompts, plist, strict=True))]

    def submit(self, scheduler: Scheduler, request_id: int, prompt: list[int], params: SamplingParams) -> Sequence:
        """Queue one more request on a running ``scheduler``; ``step`` picks it up."""
        if not prompt:
            raise ValueError(f"request {request_id}: empty prompt")
        stop = self.stop_ids if params.stop_token_ids is None else params.stop_token_ids
        gen = torch.Generator().manual_seed(params.seed) if not params.greedy else None
        seq = Sequence(request_id, list(prompt), params, frozenset(stop), len(prompt), generator=gen)
        seq.stats.prompt_tokens = len(prompt)
        scheduler.add(seq)
        return seq

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()
    ) -> list[GenerationResult]:
        """Decode every prompt to completion with continuous batching; results are in prompt order."""
        scheduler, seqs = self.start(prompts, params)
        while not scheduler.done:
            self.step(scheduler)
        return [GenerationResult(seq.output, seq.stats) for seq in seqs]

    def step(self, scheduler: Scheduler, capture: list[int] = ()
             ) -> tuple[list[tuple[Sequence, list[int]]], torch.Tensor, list[torch.Tensor]]:
        """One continuous-batching step: schedule, forward, sample, retire finished sequences.

        Returns the batch, its pre-norm hidden states ``[T, H]`` and the outputs of the ``capture`` layers (a
        speculative draft catches up from them).
        """
        scheduled = scheduler.schedule()
        if not scheduled:
            raise RuntimeError("scheduler produced an empty batch with work pending")
        meta, hidden, captured = self.forward(scheduled, capture)
        logits = self.model.logits(hidden[meta.last_token_index])
        seqs = [seq for seq, _ in scheduled]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        tokens = self.tp.broadcast(tokens.to(self.device)).tolist()
        for seq, token in zip(seqs, tokens):
            seq.stats.forward_steps += 1
            seq.append(int(token), self.cfg.max_positions)
            if seq.status is Status.FINISHED:
                scheduler.retire(seq)
        return scheduled, hidden, captured

    # -- score -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], layers: list[int] = (-1,), topk: int = 0,
              on_batch: Callable[[int], None] | None = None, keep: bool = True,
              store_hidden: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None
              ) -> ScoreOutput | None:
        """Teacher-forced forward over ``sequences``, packed into token-budget batches.

        ``layers`` are decoder layer ids (negative counts from the end). Row t of the outputs
        describes the prediction made at token t, i.e. the distribution of token t+1.
        ``on_batch`` is called with the number of tokens of each batch once it is scored (progress).
        ``keep=False``: every batch is scored (a tensor-parallel rank takes part in each collective, batched as the
        leader batches) but nothing is copied to the host, and None is returned: the ranks that write no shard.
        ``store_hidden``: what each batch's hidden states ``[t, L, H]`` become where they were computed, before the
        copy: the values to keep (a features shard's bf16 or e4m3) and each row's float32 scale ``[t, L]`` or None;
        so that the host never holds the whole call's hidden states in more bytes than those.
        """
        with stored_layout():  # torch's ops alone: features never depend on this process's timed copies
            return self._score(sequences, layers, topk, on_batch, keep, store_hidden)

    def _score(self, sequences: list[list[int]], layers: list[int], topk: int,
               on_batch: Callable[[int], None] | None, keep: bool, store_hidden: Callable | None
               ) -> ScoreOutput | None:
        n_layers = self.cfg.num_layers
        layer_ids = [lid % n_layers for lid in layers]
        for lid in layers:
            if not -n_layers <= lid < n_layers:
                raise ValueError(f"layer {lid} is out of range for a {n_layers}-layer model")
        total = sum(len(s) for s in sequences)
        host: list[torch.Tensor | None] | None = None  # hidden, scale, lp, ids, lse, tail: every row of the call
        start = row = 0
        while start < len(sequences):
            stop, tokens = start, 0
            while stop < len(sequences) and (stop == start or tokens + len(sequences[stop]) <= self.max_batch_tokens):
                tokens += len(sequences[stop])
                stop += 1
            while True:
                try:
                    out = self._score_batch(sequences[start:stop], layer_ids, topk)
                    break
                except OutOfPages:
                    if stop - start == 1:
                        raise UserError(f"sequence {start} ({len(sequences[start])} tokens) does not fit the KV "
                                        "cache; raise its budget") from None
                    stop = start + (stop - start) // 2  # fewer sequences per batch, then retry
                    tokens = sum(len(s) for s in sequences[start:stop])
            if keep:
                hidden, scale = store_hidden(out[0]) if store_hidden is not None else (out[0], None)
                parts = (hidden, scale, *out[1:])
                # each batch goes straight into its rows of one host buffer per output: no list of parts to join
                host = host or [None if p is None else torch.empty((total, *p.shape[1:]), dtype=p.dtype) for p in parts]
                for buf, part in zip(host, parts):
                    if buf is not None:
                        buf[row : row + part.shape[0]].copy_(part)
                row += tokens
            if on_batch is not None:
                on_batch(tokens)
            start = stop
        if not keep:
            return None
        if host is None:
            raise ValueError("score: no sequences to score")
        lens = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        cu = torch.zeros(len(sequences) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        hidden, scale, lp, ids, lse, tail = host
        return ScoreOutput(cu, hidden, lp, ids, lse, tail, layer_ids, scale)

    def _score_batch(
        self, batch: list[list[int]], layer_ids: list[int], topk: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs = [Sequence(i, [], SamplingParams(), frozenset(), 0) for i in range(len(batch))]
        try:
            last = self.cfg.num_layers - 1
            inner = [lid for lid in layer_ids if lid != last]
            scheduled = list(zip(seqs, batch))
            self.reserve(scheduled)
            _, final, captured = self.forward(scheduled, inner)
            by_layer = dict(zip(inner, captured))
            by_layer[last] = final
            hidden = torch.stack([by_layer[lid] for lid in layer_ids], dim=1)
            lps, ids, lses, tails = [], [], [], []
            for i in range(0, final.shape[0], LOGITS_CHUNK):
                logits = self.model.logits(final[i : i + LOGITS_CHUNK]).float()
                lse = torch.logsumexp(logits, dim=-1)
                values, idx = torch.topk(logits, topk, dim=-1) if topk else (logits[:, :0], logits[:, :0].long())
                lps.append(values - lse[:, None])
                ids.append(idx)
                lses.append(lse)
                tails.append(torch.logsumexp(logits.scatter_(-1, idx, float("-inf")), dim=-1) - lse)  # last use
            return hidden, torch.cat(lps), torch.cat(ids), torch.cat(lses), torch.cat(tails)
        finally:
            for seq in seqs:
                self.release(seq)

