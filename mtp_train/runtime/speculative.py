"""Speculative decoding in the runtime: draft-target, MTP and EAGLE, the draft on a page allocator of its own.

A decode step (every running sequence is decoding; n = its number of tokens), top to bottom:

1. **propose**: the draft's carried logits give d_1; d_2..d_k come from a linear chain of draft forwards (greedy,
   or sampled with the request's own settings);
2. **verify**: the target forwards ``[t_{n-1}, d_1..d_k]`` in one batch (``q_len = k + 1``);
3. **accept**: the pure rule (``accept_draft``) keeps a tokens and appends one more (bonus or residual);
4. the target's pages are truncated to its n + a valid positions, and the draft re-syncs over the
   verified positions (truncate, then forward), which fills its K/V and carries its next logits.

Prefill and mixed steps sample normally (``Engine.step``); the draft then catches up from that step. What each draft
holds between steps is in :mod:`mtp_train.runtime.drafters`.

Under tensor parallelism the draft and the acceptance run on the leader rank; the other ranks receive the drafts and
the decisions by broadcast and keep identical page bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.acceptance import accept_draft
from mtp_train.runtime.device import synchronize
from mtp_train.runtime.drafters import Drafter, Feed
from mtp_train.runtime.engine import Engine, GenerationResult
from mtp_train.runtime.sampling import SamplingParams, target_distribution
from mtp_train.runtime.scheduler import Scheduler
from mtp_train.runtime.sequence import Sequence, Status


@dataclass
class SpecTimings:
    """Wall time of the speculative decode steps, and the part of it spent drafting (chain and re-sync forwards)."""

    draft_s: float = 0.0
    draft_forwards: int = 0  # batched draft forwards in decode steps (k - 1 chain steps and one re-sync each)
    step_s: float = 0.0  # whole speculative decode steps: drafts, the verify forward, acceptance, bookkeeping
    steps: int = 0

    @property
    def verify_s(self) -> float:
        """The speculative steps' time outside the draft: the target's verify of k + 1 tokens and what surrounds it."""
        return self.step_s - self.draft_s


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
                synchronize(self.engine.device)
                t0 = time.perf_counter()
                if self._spec_step(scheduler):
                    synchronize(self.engine.device)
                    self.timings.step_s += time.perf_counter() - t0
                    self.timings.steps += 1
            if on_step is not None:
                on_step(seqs)
        return [GenerationResult(seq.output, seq.stats) for seq in seqs]

    # -- prefill and mixed steps -------------------------------------------------------------------------

    def _plain_step(self, scheduler: Scheduler) -> None:
        scheduled, hidden, captured = self.engine.step(scheduler, self.drafter.capture)
        states = self.drafter.features(hidden, captured)
        feeds, offset = [], 0
        for seq, new in scheduled:
            rows = states[offset : offset + len(new)]
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

    def _spec_step(self, scheduler: Scheduler) -> bool:
        """One draft-and-verify step over the running sequences; ``False`` when preemption left none to run."""
        engine, tp = self.engine, self.engine.tp
        batch = self._reserve(scheduler)
        if not batch:
            return False
        drafts, qs = self._propose(batch) if self.drafter.leader else ([[] for _ in batch], [])
        if tp.size > 1:
            packed = torch.full((len(batch), self.k), -1, dtype=torch.int64)
            for b, d in enumerate(drafts):
                packed[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
            packed = tp.broadcast(packed.to(engine.device)).cpu()
            drafts = [[int(x) for x in row[:k]] for row, (_, k) in zip(packed, batch)]
        scheduled = [(seq, [seq.tokens[-1]] + d) for (seq, _), d in zip(batch, drafts)]
        meta, hidden, captured = engine.forward(scheduled, self.drafter.capture)
        logits = engine.model.logits(hidden)
        states = self.drafter.features(hidden, captured)
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
            feeds.append(self.drafter.feed(seq, self.drafter.valid(seq) - a - 1, n - 1, states[start : start + a + 1]))
        self._sync(scheduler, feeds)
        return True
