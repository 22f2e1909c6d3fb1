"""Speculative decoding in the runtime: draft-target, MTP and EAGLE, the draft on a page allocator of its own.

A decode step (every running sequence is decoding; n = its number of tokens), top to bottom:

1. **propose**: the draft's carried logits give d_1; d_2..d_k come from a linear chain of draft forwards (greedy,
   or sampled with the request's own settings); a block draft (DFlash) gives all k from one forward, each drawn
   from its own position's distribution (the acceptance rule needs only the distribution each draft came from);
2. **verify**: the target forwards ``[t_{n-1}, d_1..d_k]`` in one batch (``q_len = k + 1``);
3. **accept**: the batched rule (``accept_batch``, or ``accept_greedy`` at T = 0; ``accept_draft`` is its one-sequence
   reference) keeps a tokens per sequence and appends one more (bonus or residual), on the device;
4. the target's pages are truncated to its n + a valid positions, and the draft re-syncs over the
   verified positions (truncate, then forward), which fills its K/V and carries its next logits.

Prefill and mixed steps sample normally (``Engine.step``); the draft then catches up from that step. What each draft
holds between steps is in :mod:`mtp_train.runtime.drafters`.

Under tensor parallelism the draft and the acceptance run on the leader rank; the other ranks receive the drafts and
the decisions by broadcast and keep identical page bookkeeping.

On a GPU the step waits for the device once: drafts, distributions and decisions stay there, the host's random
draws and metadata go there in pinned copies, and one read brings back each sequence's drafts, decision and the
target's own argmax (``docs/runtime.md``, the sync budget). The timings use device events, read once per run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.acceptance import accept_batch, accept_greedy
from mtp_train.runtime.clock import RegionClock
from mtp_train.runtime.device import to_device
from mtp_train.runtime.drafters import Drafter, Feed
from mtp_train.runtime.engine import Engine, GenerationResult
from mtp_train.runtime.sampling import SamplingParams, draw, target_distributions, uniforms
from mtp_train.runtime.scheduler import Scheduler
from mtp_train.runtime.sequence import Sequence, Status

Batch = list[tuple[Sequence, int]]  # the running sequences of a speculative step, each with its number of drafts


@dataclass
class SpecTimings:
    """Time of the speculative decode steps, and the part of it spent drafting (chain and re-sync forwards): the
    host clock on the CPU; on CUDA the device's time between events recorded at each region's ends (``RegionClock``),
    read once a ``generate`` ends, so timing adds no sync to a step."""

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
            if not self.engine.allocator.holds(len(seq.tokens) + seq.params.max_new_tokens + self._slots(self.k)[0]
                                               + page):
                raise UserError(f"request {seq.request_id}: too long for the KV cache with a draft; raise the KV budget")
        clock = RegionClock(self.engine.device)
        while not scheduler.done:
            admit = scheduler.waiting and len(scheduler.running) < scheduler.max_seqs
            if admit or any(len(s.pending) != 1 for s in scheduler.running):
                self._plain_step(scheduler, clock)
            else:
                clock.start("step")
                if self._spec_step(scheduler, clock):
                    clock.stop("step")
                    self.timings.steps += 1
                else:
                    clock.cancel("step")
            if on_step is not None:
                on_step(seqs)
        seconds = clock.settle()
        self.timings.step_s += seconds.get("step", 0.0)
        self.timings.draft_s += seconds.get("draft", 0.0)
        return [GenerationResult(seq.output, seq.stats) for seq in seqs]

    # -- prefill and mixed steps -------------------------------------------------------------------------

    def _plain_step(self, scheduler: Scheduler, clock: RegionClock) -> None:
        scheduled, hidden, captured = self.engine.step(scheduler, self.drafter.capture)
        states = self.drafter.features(hidden, captured)
        feeds, offset = [], 0
        for seq, new in scheduled:
            rows = states[offset : offset + len(new)]
            offset += len(new)
            if seq.status is Status.RUNNING:  # (no draft reservation is outstanding in a plain step)
                feeds.append(self.drafter.feed(seq, seq.draft_pages.num_tokens, seq.cached - len(new), rows))
        self._sync(scheduler, feeds, clock, timed=False)

    def _sync(self, scheduler: Scheduler, feeds: list[Feed], clock: RegionClock, timed: bool = True) -> None:
        """Truncate each draft to its feed's start, reserve its pages (preempting when short), forward; a windowed
        draft then gives back its pages below every later query's window."""
        if timed:
            clock.start("draft")
        alloc, window = self.drafter.allocator, self.drafter.window
        for f in feeds:
            alloc.truncate(f.seq.draft_pages, f.start)
        for f in feeds:
            while f.seq.status is Status.RUNNING and alloc.pages_needed(f.seq.draft_pages, len(f.tokens)) > alloc.num_free:
                scheduler.preempt(scheduler.running[-1])
            if f.seq.status is Status.RUNNING:
                alloc.reserve(f.seq.draft_pages, len(f.tokens))
        self.drafter.forward([f for f in feeds if f.seq.status is Status.RUNNING])
        for f in feeds if window else ():  # every later query stands past the feed: it reads keys above that - window
            alloc.release_below(f.seq.draft_pages, f.start + len(f.tokens) - window + 1)
        if timed:
            clock.stop("draft")
            self.timings.draft_forwards += not self.drafter.defers_writes  # (kept for the next draft forward)

    # -- speculative decode steps ------------------------------------------------------------------------

    def _k_for(self, seq: Sequence) -> int:
        """Drafts for ``seq`` this step: k, fewer only where the target's positions run out. Like vLLM, the last
        steps of a request draft k even when fewer tokens are left to emit (the output is cut after acceptance),
        so that a batch drafts one k and acceptance is counted alike (``stats.accepted``, ``stats.drafted``)."""
        return max(0, min(self.k, self.engine.cfg.max_positions - len(seq.tokens) - 1))

    def _slots(self, k: int) -> tuple[int, int]:
        """The target's and the draft's slots a step with k drafts writes past what each holds: k + 1 each."""
        return k + 1, k + 1

    def _reserve(self, scheduler: Scheduler) -> Batch:
        """Pages for a step's target and draft slots per running sequence; preempts from the back when short."""
        alloc, draft_alloc, batch = self.engine.allocator, self.drafter.allocator, []
        for seq in list(scheduler.running):
            k = self._k_for(seq)
            target, draft = self._slots(k)
            while seq.status is Status.RUNNING and not (alloc.can_reserve([(seq.pages, target)])
                                                        and draft_alloc.can_reserve([(seq.draft_pages, draft)])):
                scheduler.preempt(scheduler.running[-1])
            if seq.status is Status.RUNNING:
                alloc.reserve(seq.pages, target)
                draft_alloc.reserve(seq.draft_pages, draft)
                batch.append((seq, k))
        return [(seq, k) for seq, k in batch if seq.status is Status.RUNNING]

    def _propose(self, batch: Batch, k: int, u: torch.Tensor | None, clock: RegionClock
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Leader: the drafts ``[B, k]`` int64 on the device (row b's first k_b are its own) and, unless every
        request is greedy, the distributions ``[B, k, V]`` they were drawn from (at ``u[:, j]``, ``[B, 2k+1]``)."""
        clock.start("draft")
        drafter, seqs = self.drafter, [seq for seq, _ in batch]
        params = [seq.params for seq in seqs]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        block = drafter.block_logits(batch, k) if drafter.parallel else None  # [B, k, V]: all k in one forward
        self.timings.draft_forwards += block is not None
        for j in range(k):
            logits = block[:, j] if block is not None else torch.stack([drafter.carried[s.request_id][0] for s in seqs])
            if u is None:
                token = logits.argmax(-1)
            else:
                probs.append(target_distributions(logits, params))
                token = draw(probs[-1], u[:, j])
            tokens.append(token)
            if block is not None:  # (a block's drafts do not depend on each other: no chain)
                continue
            feeds = []
            for b, (seq, k_b) in enumerate(batch):
                if j + 1 < k_b:  # the chain's next forward, at the position after this draft's last
                    feed = drafter.chain_input(seq, token[b : b + 1])
                    feed.start = drafter.valid(seq) + j
                    feeds.append(feed)
            drafter.forward(feeds)
            self.timings.draft_forwards += bool(feeds)
        clock.stop("draft")
        device = self.engine.device
        drafts = torch.stack(tokens, 1) if tokens else torch.zeros((len(batch), 0), dtype=torch.int64, device=device)
        return drafts, (torch.stack(probs, 1) if probs else None)

    def _verify_logits(self, logits: torch.Tensor, bounds: list[int], batch: Batch, k: int) -> torch.Tensor:
        """The verify forward's ``logits [T, V]`` -> ``[B, k + 1, V]``: row b's positions 0..k_b, then its last
        one repeated (padding that the acceptance never reads)."""
        if all(k_b == k for _, k_b in batch):
            return logits.view(len(batch), k + 1, -1)
        index = torch.tensor([[bounds[b] + min(j, k_b) for j in range(k + 1)] for b, (_, k_b) in enumerate(batch)])
        return logits[to_device(index, logits.device)]

    def _decide(self, batch: Batch, k: int, drafts: torch.Tensor, qs: torch.Tensor | None, logits: torch.Tensor,
                u: torch.Tensor | None) -> torch.Tensor:
        """Leader: ``[B, 2k + 3]`` int64 on the device: accepted drafts, the next token, the drafts ``[k]`` and the
        target's argmax at each verified position ``[k + 1]``."""
        lens = to_device(torch.tensor([k_b for _, k_b in batch]), logits.device)
        own = logits.argmax(-1)  # [B, k + 1]
        if u is None:
            accepted, token = accept_greedy(drafts, own, lens)
        else:
            params = [seq.params for seq, _ in batch for _ in range(k + 1)]
            p = target_distributions(logits.flatten(0, 1), params).view(logits.shape)
            accepted, token = accept_batch(drafts, qs, p, lens, u[:, k : 2 * k], u[:, 2 * k])
        return torch.cat([accepted[:, None], token[:, None], drafts, own], 1)

    def _emit(self, scheduler: Scheduler, seq: Sequence, kept: list[int], token: int, drafted: int) -> bool:
        """Append a step's ``kept`` drafts and ``token`` to ``seq`` and count the step; ``True`` when it finished
        (then retired)."""
        emitted = 0
        for t in kept + [token]:
            seq.append(t, self.engine.cfg.max_positions)
            emitted += 1
            if seq.status is Status.FINISHED:
                break
        seq.stats.forward_steps += 1
        seq.stats.accepted.append(len(kept))
        seq.stats.emitted.append(emitted)
        seq.stats.drafted.append(drafted)
        if seq.status is Status.FINISHED:
            scheduler.retire(seq)
            return True
        return False

    def _spec_step(self, scheduler: Scheduler, clock: RegionClock) -> bool:
        """One draft-and-verify step over the running sequences; ``False`` when preemption left none to run."""
        engine, tp = self.engine, self.engine.tp
        batch = self._reserve(scheduler)
        if not batch:
            return False
        k = max(k_b for _, k_b in batch)
        greedy = all(seq.params.greedy for seq, _ in batch)
        u = None if greedy else to_device(uniforms([seq.generator for seq, _ in batch], 2 * k + 1), engine.device)
        if self.drafter.leader:
            drafts, qs = self._propose(batch, k, u, clock)
        else:
            drafts, qs = torch.zeros((len(batch), k), dtype=torch.int64, device=engine.device), None
        drafts = tp.broadcast(drafts)
        last = to_device(torch.tensor([seq.tokens[-1] for seq, _ in batch]), engine.device)
        verify = torch.cat([last[:, None], drafts], 1)  # [B, k + 1]
        scheduled = [(seq, verify[b, : k_b + 1]) for b, (seq, k_b) in enumerate(batch)]
        meta, hidden, captured = engine.forward(scheduled, self.drafter.capture)
        states = self.drafter.features(hidden, captured)
        bounds = meta.host_qo_indptr.tolist()
        if self.drafter.leader:
            logits = self._verify_logits(engine.model.logits(hidden), bounds, batch, k)
            decisions = self._decide(batch, k, drafts, qs, logits, u)
        else:
            decisions = torch.zeros((len(batch), 2 * k + 3), dtype=torch.int64, device=engine.device)
        rows = tp.broadcast(decisions).tolist()  # the step's one wait for the device
        feeds = []
        for b, ((seq, k_b), row) in enumerate(zip(batch, rows)):
            a, token, drafted = row[0], row[1], row[2 : 2 + k_b]
            if seq.params.greedy:
                own = row[2 + k : 3 + k + a]
                self.greedy_violations += sum(x != y for x, y in zip(drafted[:a] + [token], own))
            n = len(seq.tokens)
            if self._emit(scheduler, seq, drafted[:a], token, k_b):
                continue
            engine.allocator.truncate(seq.pages, n + a)  # target K/V: positions 0..n+a-1 are verified
            start = bounds[b]
            feeds.append(self.drafter.feed(seq, self.drafter.valid(seq) - a - 1, n - 1, states[start : start + a + 1]))
        self._sync(scheduler, feeds, clock)
        return True
