"""A request in flight: its tokens, its KV pages, its sampler state and its statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from mtp_train.runtime.kv_cache import PageTable
from mtp_train.runtime.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Per-request counters returned with the generated tokens."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_steps: int = 0
    preemptions: int = 0
    accepted: list[int] = field(default_factory=list)  # per speculative verification: draft tokens accepted
    emitted: list[int] = field(default_factory=list)  # per speculative verification: tokens appended
    drafted: list[int] = field(default_factory=list)  # per speculative verification: draft tokens verified (<= k)
    finish_reason: str = ""
    first_token_s: float = 0.0
    total_s: float = 0.0


@dataclass
class Sequence:
    """``tokens`` holds the prompt followed by everything generated so far.

    ``cached`` counts the tokens whose K/V are in ``pages``; the rest still need a forward.
    ``draft_pages`` hold a speculative draft's own K/V (from the same allocator), when there is a draft.
    """

    request_id: int
    tokens: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    prompt_len: int
    pages: PageTable = field(default_factory=PageTable)
    draft_pages: PageTable = field(default_factory=PageTable)
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    started: float = field(default_factory=time.perf_counter)

    @property
    def cached(self) -> int:
        return self.pages.num_tokens

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def pending(self) -> list[int]:
        """Tokens that are not in the KV cache yet (the whole text after a preemption)."""
        return self.tokens[self.cached :]

    def append(self, token: int, max_positions: int) -> None:
        if not self.output:
            self.stats.first_token_s = time.perf_counter() - self.started
        self.tokens.append(token)
        self.stats.generated_tokens = len(self.output)
        if token in self.stop_ids:
            self.finish("stop")
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish("length")
        elif len(self.tokens) >= max_positions:
            self.finish("max_positions")

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.stats.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.started
