"""Speculative decoding in the runtime: draft-target and MTP, the draft on a page allocator of its own.

A decode step (every running sequence is decoding; n = its number of tokens), top to bottom:

1. **propose**: the draft's carried logits give d_1; d_2..d_k come from a linear chain of draft forwards (greedy,
   or sampled with the request's own settings);
2. **verify**: the target forwards ``[t_{n-1}, d_1..d_k]`` in one batch (``q_len = k + 1``);
3. **accept**: the pure rule (``accept_draft``) keeps a tokens and appends one more (bonus or residual);
4. the target's pages are truncated to its n + a valid positions, and the draft re-syncs over the
   verified positions (truncate, then forward), which fills its K/V and carries its next logits.

Prefill and mixed steps sample normally (``Engine.step``); the draft then catches up from that step. Between steps,
for a running sequence with n tokens:

- the target holds K/V for positions 0..n-2 (the last token is pending), as in plain decoding;
- a **draft model** holds K/V for 0..n-1 and carries the logits that predict t_n;
- an **MTP head** holds K/V for 0..n-2 (its position i read the target's h_i and the token t_{i+1}: the token
  buffer is shifted one step left of the hidden states), carries the logits that predict t_n, and carries its
  state at n-2 that the chain feeds back as the next h (its output, or its output after its final norm: ``feedback``).

Under tensor parallelism the draft and the acceptance run on the leader rank; the other ranks receive the drafts and
the decisions by broadcast and keep identical page bookkeeping.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp_train.errors import UserError
from mtp_train.heads.base import DraftHead
from mtp_train.models.transformer import Transformer
from mtp_train.runtime.acceptance import accept_draft
from mtp_train.runtime.attention import select_backend
from mtp_train.runtime.batch import build_batch
from mtp_train.runtime.device import synchronize
from mtp_train.runtime.engine import Engine, GenerationResult
from mtp_train.runtime.kv_cache import KVPool, PageAllocator
from mtp_train.runtime.sampling import SamplingParams, target_distribution
from mtp_train.runtime.scheduler import Scheduler
from mtp_train.runtime.sequence import Sequence, Status


@dataclass
class Feed:
    """One sequence's draft forward: ``tokens`` at positions ``start..``; ``hidden [len, H]`` for a head."""

    seq: Sequence
    start: int
    tokens: list[int]
    hidden: torch.Tensor | None = None


class Drafter:
    """A draft with its own K/V pool and page allocator (``seq.draft_pages``), as many pages as the target's.

    Under tensor parallelism only the leader rank holds the draft's weights on the GPU and its K/V pool
    (``kv`` is None elsewhere); every rank keeps the same page bookkeeping.
    """

    name = ""  # what reports call it: "draft_target", "mtp", "eagle" or "bigram"

    def __init__(self, engine: Engine, num_layers: int, dtype: torch.dtype, sliding_window: int | None) -> None:
        self.engine = engine
        self.allocator = PageAllocator(engine.allocator.num_pages, engine.allocator.page_size)
        self.leader = engine.tp.rank == 0
        cfg = dataclasses.replace(self.kv_config(), num_layers=num_layers)
        self.kv = KVPool(cfg, self.allocator, dtype, engine.device) if self.leader else None
        self.backend = select_backend("auto", engine.device, sliding_window, dtype, latent=cfg.mla is not None)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.carried: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request id -> (logits [V], hidden [H])

    def kv_config(self):
        raise NotImplementedError

    def valid(self, seq: Sequence) -> int:
        """Positions the draft holds between steps for a sequence of n tokens (n, or n-1 for a head)."""
        raise NotImplementedError

    def feed(self, seq: Sequence, draft_valid: int, target_start: int, target_hidden: torch.Tensor) -> Feed:
        """What the draft must forward, holding ``draft_valid`` positions, once the target has processed
        positions ``target_start..`` (pre-norm ``target_hidden [m, H]``) and the sequence has grown."""
        raise NotImplementedError

    def chain_input(self, seq: Sequence, token: int) -> Feed:
        """The next chain forward after drafting ``token``."""
        raise NotImplementedError

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None, plan) -> torch.Tensor:
        """Forward packed inputs; returns the output hidden ``[T, H]`` (its K/V written into the pages)."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The output hidden ``[T, H]`` -> what the next chained forward reads (a head's ``feedback_state``)."""
        return out

    def forward(self, feeds: list[Feed]) -> None:
        """Run ``feeds`` (pages already reserved) and carry each one's logits and hidden at its last position."""
        if not feeds or not self.leader:
            return
        meta = build_batch([f.tokens for f in feeds], [f.start for f in feeds], [f.seq.draft_pages.pages for f in feeds],
                           self.allocator.page_size, self.engine.device)
        hidden = torch.cat([f.hidden for f in feeds]) if feeds[0].hidden is not None else None
        out = self.run(meta.tokens, meta.positions, hidden, self.backend.plan(meta, *self.heads))
        last = out[meta.last_token_index]
        logits, fed_back = self.logits(last), self.feedback(last)
        for i, f in enumerate(feeds):
            self.carried[f.seq.request_id] = (logits[i], fed_back[i])


class TokenDrafter(Drafter):
    """A draft that reads tokens only (no target hidden states): it holds every token of the sequence and
    catches up by feeding the ones it has not seen."""

    def valid(self, seq: Sequence) -> int:
        return len(seq.tokens)

    def feed(self, seq: Sequence, draft_valid: int, target_start: int, target_hidden: torch.Tensor) -> Feed:
        return Feed(seq, draft_valid, seq.tokens[draft_valid:])

    def chain_input(self, seq: Sequence, token: int) -> Feed:
        return Feed(seq, 0, [token])


class DraftModelDrafter(TokenDrafter):
    """Draft-target: a small LLM of any supported family, sharing the target's tokenizer."""

    name = "draft_target"

    def __init__(self, engine: Engine, model: Transformer) -> None:
        if model.cfg.vocab_size != engine.cfg.vocab_size:
            raise UserError(f"draft model vocab {model.cfg.vocab_size} differs from the target's "
                            f"{engine.cfg.vocab_size}; a draft must share the target's tokenizer")
        self.model = model
        super().__init__(engine, model.cfg.num_layers, model.output.weight.dtype, model.cfg.sliding_window)

    def kv_config(self):
        return self.model.cfg

    def run(self, tokens, positions, hidden, plan):
        return self.model(tokens, positions, plan, self.kv.layers)[0]

    def logits(self, out):
        return self.model.logits(out)


class HeadDrafter(Drafter):
    """MTP (or EAGLE): a trained head over the target's hidden states, embedding and lm_head."""

    def __init__(self, engine: Engine, head: DraftHead, name: str | None = None, vocab: torch.Tensor | None = None):
        """``vocab [N]``: the ids it may draft (``eval.draft_vocab``): logits from those lm_head rows, -inf elsewhere."""
        self.name = name or head.spec.kind  # "mtp", "eagle", or "target_mtp" (a checkpoint's own MTP layer)
        self.head = (head.to(engine.device, engine.model.output.weight.dtype) if engine.tp.rank == 0 else head).eval()
        self.target = engine.model
        self.vocab = None if vocab is None else vocab.to(engine.device)
        self.vocab_rows = None if vocab is None else engine.model.output.weight[self.vocab].contiguous()  # [N, H]
        super().__init__(engine, len(head.layers), engine.model.output.weight.dtype, None)

    def kv_config(self):
        return self.head.spec.target

    def valid(self, seq: Sequence) -> int:
        return len(seq.tokens) - 1

    def feed(self, seq: Sequence, draft_valid: int, target_start: int, target_hidden: torch.Tensor) -> Feed:
        assert draft_valid == target_start, "the head and the target hold the same positions"
        m = target_hidden.shape[0]  # position i reads h_i and t_{i+1}
        side = self.target.norm(target_hidden) if self.head.spec.hidden_input == "post_norm" else target_hidden
        return Feed(seq, target_start, seq.tokens[target_start + 1 : target_start + 1 + m], side)

    def chain_input(self, seq: Sequence, token: int) -> Feed:
        return Feed(seq, 0, [token], self.carried[seq.request_id][1][None])

    def run(self, tokens, positions, hidden, plan):
        return self.head.run(self.target.tok_embeddings(tokens), hidden, positions, plan, self.kv.layers)

    def logits(self, out):
        x = self.head.lm_head_input(out)
        if self.vocab is None:
            return self.target.output(x).float()
        full = x.new_full((x.shape[0], self.target.cfg.vocab_size), float("-inf"), dtype=torch.float32)
        return full.index_copy_(1, self.vocab, F.linear(x, self.vocab_rows).float())

    def feedback(self, out):
        return self.head.feedback_state(out)


class BigramDrafter(TokenDrafter):
    """The baseline draft: each token's most frequent successor in the training data (no K/V, no network). Its
    distribution is one-hot, valid at any temperature (a token is accepted with the target's probability of it)."""

    name = "bigram"

    def __init__(self, engine: Engine, successor: torch.Tensor) -> None:
        self.successor = successor.to(engine.device)  # [V] int64
        super().__init__(engine, 0, engine.model.output.weight.dtype, None)

    @staticmethod
    def from_tokens(sequences: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
        """``[V]`` most frequent successor of each token over ``sequences`` (a token never seen maps to itself)."""
        pairs = torch.cat([seq[:-1].long() * vocab_size + seq[1:].long() for seq in sequences if seq.numel() > 1])
        ids, counts = torch.unique(pairs, return_counts=True)
        first, second = ids // vocab_size, ids % vocab_size
        best = torch.zeros(vocab_size, dtype=counts.dtype).scatter_reduce(0, first, counts, "amax")
        top = counts == best[first]  # ties go to the smallest token id
        successor = torch.arange(vocab_size).scatter_reduce(0, first[top], second[top], "amin", include_self=False)
        return successor

    def kv_config(self):
        return self.engine.cfg

    def forward(self, feeds: list[Feed]) -> None:
        if not self.leader:
            return
        vocab = self.engine.cfg.vocab_size
        for f in feeds:
            logits = torch.full((vocab,), float("-inf"), device=self.engine.device)
            logits[self.successor[f.tokens[-1]]] = 0.0
            self.carried[f.seq.request_id] = (logits, logits)


@dataclass
class SpecTimings:
    """Wall time spent drafting in decode steps (chain and re-sync forwards), and how many forwards that was."""

    draft_s: float = 0.0
    draft_forwards: int = 0  # batched draft forwards in decode steps (k - 1 chain steps and one re-sync each)


class SpeculativeDecoder:
    """``generate()`` with a draft: lossless by construction (the pure acceptance rule).

    ``greedy_violations`` counts, over greedy requests, emitted tokens that differ from the target's own argmax
    in the verification forward that decided them: losslessness as the acceptance rule guarantees it, checked
    where it holds exactly whatever the dtype (plain decoding in bf16 may still differ at near-ties, since a
    verify forward batches other tokens than a decode step).
    """

    def __init__(self, engine: Engine, drafter: Drafter, k: int) -> None:
        if k < 1:
            raise ValueError("k must be at least 1")
        self.engine, self.drafter, self.k = engine, drafter, k
        self.timings = SpecTimings()
        self.greedy_violations = 0

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams(),
        on_step: Callable[[list[Sequence]], None] | None = None,
    ) -> list[GenerationResult]:
        """Decode every prompt to completion; ``on_step`` sees the requests' sequences after each step (progress)."""
        scheduler, seqs = self.engine.start(prompts, params, draft_allocator=self.drafter.allocator)
        page = self.engine.allocator.page_size
        for seq in seqs:  # room for one sequence alone, with a step of drafts, guarantees progress
            if len(seq.tokens) + seq.params.max_new_tokens + self.k + 1 + page > self.engine.allocator.num_pages * page:
                raise UserError(f"request {seq.request_id}: too long for the KV cache with a draft; raise the KV budget")
        while not scheduler.done:
            admit = scheduler.waiting and len(scheduler.running) < scheduler.max_seqs
            if admit or any(len(s.pending) != 1 for s in scheduler.running):
                self._plain_step(scheduler)
            else:
                self._spec_step(scheduler)
            if on_step is not None:
                on_step(seqs)
        return [GenerationResult(seq.output, seq.stats) for seq in seqs]

    # -- prefill and mixed steps -------------------------------------------------------------------------

    def _plain_step(self, scheduler: Scheduler) -> None:
        scheduled, hidden = self.engine.step(scheduler)
        feeds, offset = [], 0
        for seq, new in scheduled:
            rows = hidden[offset : offset + len(new)]
            offset += len(new)
            if seq.status is Status.RUNNING:  # (no draft reservation is outstanding in a plain step)
                feeds.append(self.drafter.feed(seq, seq.draft_pages.num_tokens, seq.cached - len(new), rows))
        self._sync(scheduler, feeds, timed=False)

    def _sync(self, scheduler: Scheduler, feeds: list[Feed], timed: bool = True) -> None:
        """Truncate each draft to its feed's start, reserve its pages (preempting when short), forward."""
        if timed:
            synchronize(self.engine.device)
        t0 = time.perf_counter()
        alloc = self.drafter.allocator
        for f in feeds:
            alloc.truncate(f.seq.draft_pages, f.start)
        for f in feeds:
            while f.seq.status is Status.RUNNING and alloc.pages_needed(f.seq.draft_pages, len(f.tokens)) > alloc.num_free:
                scheduler.preempt(scheduler.running[-1])
            if f.seq.status is Status.RUNNING:
                alloc.reserve(f.seq.draft_pages, len(f.tokens))
        self.drafter.forward([f for f in feeds if f.seq.status is Status.RUNNING])
        if timed:
            synchronize(self.engine.device)
            self.timings.draft_s += time.perf_counter() - t0
            self.timings.draft_forwards += 1

    # -- speculative decode steps ------------------------------------------------------------------------

    def _k_for(self, seq: Sequence) -> int:
        """Drafts for ``seq`` this step: k, fewer only where the target's positions run out. Like vLLM, the last
        steps of a request draft k even when fewer tokens are left to emit (the output is cut after acceptance),
        so that a batch drafts one k and acceptance is counted alike (``stats.accepted``, ``stats.drafted``)."""
        return max(0, min(self.k, self.engine.cfg.max_positions - len(seq.tokens) - 1))

    def _reserve(self, scheduler: Scheduler) -> list[tuple[Sequence, int]]:
        """Pages for k+1 target and draft positions per running sequence; preempts from the back when short."""
        alloc, draft_alloc, batch = self.engine.allocator, self.drafter.allocator, []
        for seq in list(scheduler.running):
            k = self._k_for(seq)
            while seq.status is Status.RUNNING and (alloc.pages_needed(seq.pages, k + 1) > alloc.num_free
                                                    or draft_alloc.pages_needed(seq.draft_pages, k + 1) > draft_alloc.num_free):
                scheduler.preempt(scheduler.running[-1])
            if seq.status is Status.RUNNING:
                alloc.reserve(seq.pages, k + 1)
                draft_alloc.reserve(seq.draft_pages, k + 1)
                batch.append((seq, k))
        return [(seq, k) for seq, k in batch if seq.status is Status.RUNNING]

    def _propose(self, batch: list[tuple[Sequence, int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Leader: each sequence's draft tokens and the distributions ``[k, V]`` they were drawn from."""
        synchronize(self.engine.device)
        t0 = time.perf_counter()
        drafter = self.drafter
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        for j in range(max((k for _, k in batch), default=0)):
            feeds = []
            for b, (seq, k) in enumerate(batch):
                if j >= k:
                    continue
                q = target_distribution(drafter.carried[seq.request_id][0][None], seq.params)[0]
                # (the request's generator lives on the CPU, as in plain sampling: draw there)
                token = int(q.argmax()) if seq.params.greedy else int(torch.multinomial(q.cpu(), 1, generator=seq.generator))
                tokens[b].append(token)
                probs[b].append(q)
                if j + 1 < k:  # the chain's next forward, at the position after this draft's last
                    feed = drafter.chain_input(seq, token)
                    feed.start = drafter.valid(seq) + j
                    feeds.append(feed)
            drafter.forward(feeds)
            self.timings.draft_forwards += bool(feeds)
        synchronize(self.engine.device)
        self.timings.draft_s += time.perf_counter() - t0
        return tokens, [torch.stack(p) if p else torch.zeros(0) for p in probs]

    def _spec_step(self, scheduler: Scheduler) -> None:
        engine, tp = self.engine, self.engine.tp
        batch = self._reserve(scheduler)
        if not batch:
            return
        drafts, qs = self._propose(batch) if self.drafter.leader else ([[] for _ in batch], [])
        if tp.size > 1:
            packed = torch.full((len(batch), self.k), -1, dtype=torch.int64)
            for b, d in enumerate(drafts):
                packed[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
            packed = tp.broadcast(packed.to(engine.device)).cpu()
            drafts = [[int(x) for x in row[:k]] for row, (_, k) in zip(packed, batch)]
        scheduled = [(seq, [seq.tokens[-1]] + d) for (seq, _), d in zip(batch, drafts)]
        meta, hidden, _ = engine.forward(scheduled)
        logits = engine.model.logits(hidden)
        decisions = torch.zeros(len(batch), 2, dtype=torch.int64)
        if self.drafter.leader:
            for b, (seq, _) in enumerate(batch):
                rows = logits[int(meta.qo_indptr[b]) : int(meta.qo_indptr[b + 1])]
                p = target_distribution(rows, seq.params)
                a, token = accept_draft(torch.tensor(drafts[b], dtype=torch.int64), qs[b], p, seq.generator)
                decisions[b] = torch.tensor([a, token])
                if seq.params.greedy:
                    own = rows[: a + 1].argmax(-1).tolist()
                    self.greedy_violations += sum(x != y for x, y in zip(drafts[b][:a] + [token], own))
        decisions = tp.broadcast(decisions.to(engine.device)).cpu().tolist()
        feeds = []
        for b, ((seq, _), (a, token)) in enumerate(zip(batch, decisions)):
            n = len(seq.tokens)
            emitted = 0
            for t in drafts[b][:a] + [token]:
                seq.append(t, engine.cfg.max_positions)
                emitted += 1
                if seq.status is Status.FINISHED:
                    break
            seq.stats.forward_steps += 1
            seq.stats.accepted.append(a)
            seq.stats.emitted.append(emitted)
            seq.stats.drafted.append(len(drafts[b]))
            if seq.status is Status.FINISHED:
                scheduler.retire(seq)
                continue
            engine.allocator.truncate(seq.pages, n + a)  # target K/V: positions 0..n+a-1 are verified
            start = int(meta.qo_indptr[b])
            feeds.append(self.drafter.feed(seq, self.drafter.valid(seq) - a - 1, n - 1, hidden[start : start + a + 1]))
        self._sync(scheduler, feeds)
