"""Paged KV cache: a page allocator and a page pool per model.

The target's pool and allocator belong to the engine. A speculative draft has a pool of its own with an
allocator of its own holding as many pages as the target's (``Sequence.draft_pages``): the draft's pages are
as small as its K/V (a one-layer head beside a 30-layer target: 1/30 of a target page), so speculation takes
memory in proportion to the draft's size and leaves the target its whole capacity. Preempting or retiring a
sequence releases both. A draft with a sliding window (``head.window``) gives back, as its sequences grow, the
pages wholly below every later query's window (``PageAllocator.release_below``): a long prompt holds the window's
pages of draft K/V, not the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.models.config import ModelConfig


class OutOfPages(Exception):
    """Not enough free pages right now. Recoverable: the scheduler waits or preempts."""


@dataclass
class PageTable:
    """The pages of one sequence, in order, and how many token slots are filled."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PageAllocator:
    """Free-list allocator of ``num_pages`` pages of ``page_size`` token slots; with ``stand_in``, one more page
    (``pool_pages``) stands in for the pages given back below a window, never handed out or freed: what is written
    there is never read."""

    def __init__(self, num_pages: int, page_size: int, stand_in: bool = False) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self.stand_in = num_pages if stand_in else None
        self.pool_pages = num_pages + stand_in

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, table: PageTable, new_tokens: int) -> int:
        total = table.num_tokens + new_tokens
        return max(0, -(-total // self.page_size) - len(table.pages))

    def reserve(self, table: PageTable, new_tokens: int) -> None:
        """Grow ``table`` so that ``new_tokens`` more tokens fit; all or nothing."""
        need = self.pages_needed(table, new_tokens)
        if need > len(self._free):
            raise OutOfPages(f"need {need} pages, {len(self._free)} free")
        for _ in range(need):
            table.pages.append(self._free.pop())
        table.num_tokens += new_tokens

    def truncate(self, table: PageTable, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens (rejected speculative tokens go), freeing emptied pages."""
        keep = -(-num_tokens // self.page_size)
        while len(table.pages) > keep:
            page = table.pages.pop()
            if page != self.stand_in:
                self._free.append(page)
        table.num_tokens = min(table.num_tokens, num_tokens)

    def release_below(self, table: PageTable, position: int) -> None:
        """Give back the pages wholly below ``position`` (no query will read them again), the stand-in page taking
        their place in ``table`` so that positions keep their slots."""
        assert self.stand_in is not None, "an allocator without a stand-in page keeps every page"
        for i in range(min(len(table.pages), max(0, position) // self.page_size)):
            if table.pages[i] != self.stand_in:
                self._free.append(table.pages[i])
                table.pages[i] = self.stand_in

    def free(self, table: PageTable) -> None:
        self.truncate(table, 0)


class KVPool:
    """K and V pages of one model: ``k[layer]`` and ``v[layer]`` are ``[num_pages, page_size, kv_heads, dim]``.

    An MLA model (DeepSeek) caches one latent per token in ``k`` (``kv_heads`` 1, ``dim`` its latent and rope
    key) and nothing in ``v`` (``dim`` 0): see ``ModelConfig.kv_entry``.
    """

    def __init__(
        self, cfg: ModelConfig, allocator: PageAllocator, dtype: torch.dtype, device: torch.device, tp_size: int = 1
    ) -> None:
        heads, k_dim, v_dim = cfg.kv_entry(tp_size)
        pages = (cfg.num_layers, allocator.pool_pages, allocator.page_size, heads)
        self.k = torch.zeros((*pages, k_dim), dtype=dtype, device=device)
        self.v = torch.zeros((*pages, v_dim), dtype=dtype, device=device)
        self.layers = [(self.k[i], self.v[i]) for i in range(cfg.num_layers)]  # per-layer views

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of flat slots ``src [N]`` to slots ``dst [N]`` (int64 on the pool's device) in every layer,
        all read before any is written: a tree's accepted path packed behind its context."""
        for cache in (self.k, self.v):
            if cache.numel() == 0:  # (an MLA pool's v)
                continue
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, dst] = flat[:, src]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp_size: int) -> int:
        """What one token slot of this pool takes on one rank, all layers."""
        heads, k_dim, v_dim = cfg.kv_entry(tp_size)
        return cfg.num_layers * heads * (k_dim + v_dim) * dtype.itemsize

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, page_size: int, bytes_budget: int, dtype: torch.dtype, tp_size: int) -> int:
        """How many pages of this model fit in ``bytes_budget``."""
        return max(1, bytes_budget // (page_size * KVPool.bytes_per_token(cfg, dtype, tp_size)))
