"""Paged KV cache: a page allocator and a page pool per model.

The target's pool and allocator belong to the engine. A speculative draft has a pool of its own with an
allocator of its own holding as many pages as the target's (``Sequence.draft_pages``): the draft's pages are
as small as its K/V (a one-layer head beside a 30-layer target: 1/30 of a target page), so speculation takes
memory in proportion to the draft's size and leaves the target its whole capacity. Preempting or retiring a
sequence releases both. A draft with a sliding window (``head.window``) gives back, as its sequences grow, the
pages wholly below every later query's window (``PageAllocator.release_below``): a long prompt holds the window's
pages of draft K/V, not the prompt's. A target whose layers differ in window (Gemma 3: five sliding layers in six)
keeps its windowed layers' K/V in a pool of their own (``SplitAllocator``), whose pages go back in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.models.config import ModelConfig
from mtp_train.runtime.device import to_device


class OutOfPages(Exception):
    """Not enough free pages right now. Recoverable: the scheduler waits or preempts."""


@dataclass
class PageTable:
    """The pages of one sequence, in order, and how many token slots are filled."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    window: PageTable | None = None  # the same positions' pages in a ``SplitAllocator``'s windowed pool

    def slots(self, positions: list[int], page_size: int) -> list[int]:
        """The flat cache slots (``page * page_size + offset``) of ``positions``."""
        return [self.pages[p // page_size] * page_size + p % page_size for p in positions]


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

    def can_reserve(self, grow: list[tuple[PageTable, int]]) -> bool:
        """Whether every ``(table, new_tokens)`` of ``grow`` can be reserved at once."""
        return sum(self.pages_needed(t, n) for t, n in grow) <= self.num_free

    def holds(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits this allocator when it has every page."""
        return num_tokens <= self.num_pages * self.page_size

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


class SplitAllocator(PageAllocator):
    """The pages of a target whose layers differ in window (Gemma 3): its global layers' (this allocator's own, each
    table's ``pages``) and its windowed layers' (``windowed``'s, each table's ``window`` table). The windowed pool
    keeps only the pages of each sequence's ``window`` last positions: at each reservation, the pages below every
    later query's window go back (``release_below``), so that a long sequence holds the window's pages of them.
    A step's new tokens take pages in both (a prefill's whole prompt, for the step)."""

    def __init__(self, num_pages: int, page_size: int, window_pages: int, window: int) -> None:
        super().__init__(num_pages, page_size)
        self.windowed = PageAllocator(window_pages, page_size, stand_in=True)
        self.window = window

    def _window_table(self, table: PageTable) -> PageTable:
        """``table``'s windowed table, its pages below the window of the positions to come given back first."""
        if table.window is None:
            table.window = PageTable()
        self.windowed.release_below(table.window, table.num_tokens - self.window + 1)
        return table.window

    def can_reserve(self, grow: list[tuple[PageTable, int]]) -> bool:
        return super().can_reserve(grow) and self.windowed.can_reserve([(self._window_table(t), n) for t, n in grow])

    def holds(self, num_tokens: int) -> bool:
        return super().holds(num_tokens) and self.windowed.holds(num_tokens)

    def reserve(self, table: PageTable, new_tokens: int) -> None:
        window = self._window_table(table)  # (before the table grows: its window is the positions to come's)
        if not self.can_reserve([(table, new_tokens)]):
            raise OutOfPages(f"need {self.pages_needed(table, new_tokens)} pages and "
                             f"{self.windowed.pages_needed(window, new_tokens)} windowed pages, "
                             f"{self.num_free} and {self.windowed.num_free} free")
        super().reserve(table, new_tokens)
        self.windowed.reserve(window, new_tokens)

    def truncate(self, table: PageTable, num_tokens: int) -> None:
        super().truncate(table, num_tokens)
        if table.window is not None:
            self.windowed.truncate(table.window, num_tokens)


def window_pool_pages(num_pages: int, page_size: int, window: int, max_seqs: int, max_batch_tokens: int) -> int:
    """How many pages a ``SplitAllocator``'s windowed pool takes, of the ``num_pages`` it would have beside a global
    pool of as many: each of ``max_seqs`` sequences' window (and the page it starts in), and one step's new tokens."""
    return min(num_pages, max_seqs * (-(-window // page_size) + 1) + -(-max_batch_tokens // page_size) + max_seqs)


class KVPool:
    """K and V pages of one model: ``k[layer]`` and ``v[layer]`` are ``[num_pages, page_size, kv_heads, dim]``.

    An MLA model (DeepSeek) caches one latent per token in ``k`` (``kv_heads`` 1, ``dim`` its latent and rope
    key) and nothing in ``v`` (``dim`` 0): see ``ModelConfig.kv_entry``. On a ``SplitAllocator``, ``k``/``v`` hold
    the global layers and ``window_k``/``window_v`` the windowed ones (``ModelConfig.layer_window``), on the
    windowed pool's pages; ``layers`` are every layer's, in order.
    """

    def __init__(
        self, cfg: ModelConfig, allocator: PageAllocator, dtype: torch.dtype, device: torch.device, tp_size: int = 1
    ) -> None:
        heads, k_dim, v_dim = cfg.kv_entry(tp_size)
        split = isinstance(allocator, SplitAllocator)
        self.windowed = [split and cfg.layer_window(i) is not None for i in range(cfg.num_layers)]
        self.page_size = allocator.page_size

        def pool(layers: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (layers, pages, allocator.page_size, heads)
            return (torch.zeros((*shape, k_dim), dtype=dtype, device=device),
                    torch.zeros((*shape, v_dim), dtype=dtype, device=device))

        n_windowed = sum(self.windowed)
        self.k, self.v = pool(cfg.num_layers - n_windowed, allocator.pool_pages)
        self.window_k, self.window_v = pool(n_windowed, allocator.windowed.pool_pages if split else 0)
        counts = [0, 0]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per-layer views
        for w in self.windowed:
            k, v = (self.window_k, self.window_v) if w else (self.k, self.v)
            self.layers.append((k[counts[w]], v[counts[w]]))
            counts[w] += 1

    def slots(self, table: PageTable, positions: list[int]) -> list[list[int]]:
        """The flat slots of ``table``'s ``positions`` in each of this pool's caches: the global layers', then, where
        the pool is split, the windowed layers'."""
        tables = [table] + ([table.window] if self.window_k.shape[0] else [])
        return [t.slots(positions, self.page_size) for t in tables]

    def move(self, src: list[list[int]], dst: list[list[int]]) -> None:
        """Copy the K/V of the slots ``src[i]`` to the slots ``dst[i]`` of the i-th cache (``slots``'s order) in every
        layer, all read before any is written: a tree's accepted path packed behind its context."""
        device = self.k.device
        for caches, s, d in zip(((self.k, self.v), (self.window_k, self.window_v)), src, dst):
            s_t, d_t = to_device(torch.tensor(s), device), to_device(torch.tensor(d), device)
            for cache in caches:
                if cache.numel() == 0:  # (an MLA pool's v)
                    continue
                flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
                flat[:, d_t] = flat[:, s_t]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp_size: int) -> int:
        """What one token slot of this pool takes on one rank, all layers."""
        heads, k_dim, v_dim = cfg.kv_entry(tp_size)
        return cfg.num_layers * heads * (k_dim + v_dim) * dtype.itemsize

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, page_size: int, bytes_budget: int, dtype: torch.dtype, tp_size: int) -> int:
        """How many pages of this model fit in ``bytes_budget``."""
        return max(1, bytes_budget // (page_size * KVPool.bytes_per_token(cfg, dtype, tp_size)))
