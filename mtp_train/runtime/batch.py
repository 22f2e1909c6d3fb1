"""Per-step batch metadata as flat ragged tensors (indptr style), shared by every attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchMetadata:
    """One forward over B sequences with T new tokens in total, packed without padding.

    - ``tokens [T]`` int64, ``positions [T]`` int64: new tokens and their absolute positions;
    - ``qo_indptr [B+1]`` int32: sequence b's new tokens are ``tokens[qo_indptr[b]:qo_indptr[b+1]]``;
    - ``kv_lens [B]`` int32: cached tokens of b after this step (old plus new);
    - ``page_indptr [B+1]``, ``page_indices [P]`` int32: b's pages are
      ``page_indices[page_indptr[b]:page_indptr[b+1]]``;
    - ``last_page_len [B]`` int32: filled slots of b's last page;
    - ``slot_mapping [T]`` int64: flat cache slot (``page * page_size + offset``) of each new token.

    A prefill has ``q_len == kv_len``; a decode has ``q_len == 1``; a speculative verify has
    ``q_len == k + 1``. One batch may mix them.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.numel()

    @property
    def last_token_index(self) -> torch.Tensor:
        """``[B]`` index into the T new tokens of each sequence's last new token."""
        return self.qo_indptr[1:].long() - 1


def build_batch(
    new_tokens: list[list[int]],
    cached_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device,
) -> BatchMetadata:
    """Metadata for sequences that already hold ``cached_lens[b]`` tokens and append ``new_tokens[b]``.

    ``page_tables[b]`` must already have room for all ``cached_lens[b] + len(new_tokens[b])`` tokens.
    """
    q_lens = torch.tensor([len(t) for t in new_tokens], dtype=torch.int64)
    cached = torch.tensor(cached_lens, dtype=torch.int64)
    kv_lens = cached + q_lens
    qo_indptr = torch.zeros(len(new_tokens) + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(q_lens, 0)
    num_pages = torch.tensor([len(p) for p in page_tables], dtype=torch.int64)
    page_indptr = torch.zeros(len(page_tables) + 1, dtype=torch.int64)
    page_indptr[1:] = torch.cumsum(num_pages, 0)
    page_indices = torch.tensor([p for pages in page_tables for p in pages], dtype=torch.int64)

    seq_of_token = torch.repeat_interleave(torch.arange(len(new_tokens)), q_lens)
    positions = torch.arange(int(qo_indptr[-1])) - qo_indptr[seq_of_token] + cached[seq_of_token]
    page_of_token = page_indices[page_indptr[seq_of_token] + positions // page_size]
    slot_mapping = page_of_token * page_size + positions % page_size
    last_page_len = (kv_lens - 1) % page_size + 1

    def to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    return BatchMetadata(
        tokens=to(torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.int64), torch.int64),
        positions=to(positions, torch.int64),
        qo_indptr=to(qo_indptr, torch.int32),
        kv_lens=to(kv_lens, torch.int32),
        page_indptr=to(page_indptr, torch.int32),
        page_indices=to(page_indices, torch.int32),
        last_page_len=to(last_page_len, torch.int32),
        slot_mapping=to(slot_mapping, torch.int64),
        page_size=page_size,
    )
