"""Continuous batching under a token budget, with preemption when KV pages run out.

Each step first gives every running sequence its pending tokens (one, in plain decoding),
then admits waiting sequences for prefill while the token budget, the sequence limit and
the free pages allow. When a running sequence cannot get a page, the most recently admitted
one is preempted: its pages are freed and it goes back to the front of the queue, to be
prefilled again (prompt plus what it has generated) once pages free up. Nothing crashes and
no other sequence's pages are touched.
"""

from __future__ import annotations

from collections import deque

from mtp_train.errors import UserError
from mtp_train.runtime.kv_cache import OutOfPages, PageAllocator
from mtp_train.runtime.sequence import Sequence, Status


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_batch_tokens: int, max_seqs: int,
                 draft_allocator: PageAllocator | None = None) -> None:
        self.allocator = allocator
        self.draft_allocator = draft_allocator or allocator  # a speculative draft's own pages (seq.draft_pages)
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        worst = len(seq.tokens) + seq.params.max_new_tokens
        if not self.allocator.holds(worst):
            raise UserError(
                f"request {seq.request_id}: {worst} tokens (prompt plus max_new_tokens) exceed the KV cache's "
                f"{self.allocator.num_pages * self.allocator.page_size} slots (or its windowed layers'); raise the KV "
                "budget or lower max_new_tokens"
            )
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages (target and draft) and queue it, first, to be prefilled again."""
        self.allocator.free(seq.pages)
        self.draft_allocator.free(seq.draft_pages)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[tuple[Sequence, list[int]]]:
        """This step's batch: each sequence with the tokens it feeds the model."""
        batch: list[tuple[Sequence, list[int]]] = []
        budget = self.max_batch_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            new = seq.pending
            while True:
                try:
                    self.allocator.reserve(seq.pages, len(new))
                    break
                except OutOfPages:
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is seq:
                        break
            if seq.status is Status.RUNNING:
                batch.append((seq, new))
                budget -= len(new)
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            new = seq.pending
            if batch and len(new) > budget:
                break
            if not self.allocator.can_reserve([(seq.pages, len(new))]):
                break
            self.allocator.reserve(seq.pages, len(new))
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, new))
            budget -= len(new)
        return batch

    def retire(self, seq: Sequence) -> None:
        """Release a finished sequence's pages and its batch slot."""
        self.allocator.free(seq.pages)
        self.draft_allocator.free(seq.draft_pages)
        self.running.remove(seq)
