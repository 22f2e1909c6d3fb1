"""Per-step batch metadata as flat ragged tensors (indptr style), shared by every attention backend.

The metadata is built on the host, where the page tables live, and reaches a GPU in one pinned, non-blocking copy
per step; the host keeps its own copy of the small per-sequence arrays (``host_*``), so that planning a step never
reads the device back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.runtime.device import to_device


@dataclass(frozen=True)
class TreeMask:
    """Attention among a speculative tree's tokens, where slot order is not ancestry: query i of sequence b sees
    every key before slot ``prefix[b]`` (its context) and, of the keys from ``prefix[b]`` on, those where
    ``bits[b][i, j]`` (``[q_b, kv_len_b - prefix[b]]`` bool on the device: its ancestors and itself)."""

    prefix: list[int]
    bits: list[torch.Tensor]


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
    ``q_len == k + 1``. One batch may mix them. A tree's tokens (``tree``) take consecutive slots but their
    positions are their depths in the tree: ``positions`` are then what the model's rotary embedding reads, the
    slots follow ``kv_lens`` alone.

    ``host_qo_indptr [B+1]``, ``host_kv_lens [B]``, ``host_page_indptr [B+1]``, ``host_last_page_len [B]`` are
    the same arrays on the host (int32; pinned on CUDA), for planners that run there.
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
    host_qo_indptr: torch.Tensor
    host_kv_lens: torch.Tensor
    host_page_indptr: torch.Tensor
    host_last_page_len: torch.Tensor
    tree: TreeMask | None = None

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.numel()

    @property
    def last_token_index(self) -> torch.Tensor:
        """``[B]`` index into the T new tokens of each sequence's last new token."""
        return self.qo_indptr[1:].long() - 1


def build_batch(
    new_tokens: list[list[int]] | list[torch.Tensor],
    cached_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device,
    positions: torch.Tensor | None = None,
    tree: TreeMask | None = None,
) -> BatchMetadata:
    """Metadata for sequences that already hold ``cached_lens[b]`` tokens and append ``new_tokens[b]``: lists of
    ids on the host, or ``[n_b]`` int64 tensors already on ``device`` (a draft chain's own samples).

    ``page_tables[b]`` must already have room for all ``cached_lens[b] + len(new_tokens[b])`` tokens.
    ``positions [T]`` int64 (on the host, or already on ``device``): the tokens' positions where they are not their
    slots (a tree's).
    """
    on_device = bool(new_tokens) and isinstance(new_tokens[0], torch.Tensor)
    q_lens = torch.tensor([len(t) for t in new_tokens], dtype=torch.int64)
    cached = torch.tensor(cached_lens, dtype=torch.int64)
    kv_lens = cached + q_lens
    qo_indptr = torch.zeros(len(new_tokens) + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(q_lens, 0)
    num_pages = torch.tensor([len(p) for p in page_tables], dtype=torch.int64)
    page_indptr = torch.zeros(len(page_tables) + 1, dtype=torch.int64)
    page_indptr[1:] = torch.cumsum(num_pages, 0)
    page_indices = torch.tensor([p for pages in page_tables for p in pages], dtype=torch.int64)

    num_tokens = int(qo_indptr[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(new_tokens)), q_lens, output_size=num_tokens)
    slots = torch.arange(num_tokens) - qo_indptr[seq_of_token] + cached[seq_of_token]
    page_of_token = page_indices[page_indptr[seq_of_token] + slots // page_size]
    slot_mapping = page_of_token * page_size + slots % page_size
    given = positions  # (moved below unless it is on the device already)
    positions = slots if given is None or given.device != torch.device("cpu") else given
    last_page_len = (kv_lens - 1) % page_size + 1
    tokens = torch.cat(new_tokens) if on_device else torch.tensor([t for seq in new_tokens for t in seq],
                                                                    dtype=torch.int64)
    host = {"positions": positions, "qo_indptr": qo_indptr, "kv_lens": kv_lens, "page_indptr": page_indptr,
            "page_indices": page_indices, "last_page_len": last_page_len, "slot_mapping": slot_mapping}
    if not on_device:
        host["tokens"] = tokens
    moved = _to_device(host, device)
    small = {name: _pinned(host[name].to(torch.int32), device)
             for name in ("qo_indptr", "kv_lens", "page_indptr", "last_page_len")}
    int32 = {"qo_indptr", "kv_lens", "page_indptr", "page_indices", "last_page_len"}
    fields = {name: t.to(torch.int32) if name in int32 else t for name, t in moved.items()}
    if given is not None and given.device != torch.device("cpu"):
        fields["positions"] = given
    return BatchMetadata(
        tokens=fields.pop("tokens", tokens), **fields, page_size=page_size,
        **{f"host_{name}": t for name, t in small.items()}, tree=tree,
    )


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` in pinned memory when ``device`` is a GPU (so that copies from it need not wait), else itself."""
    return host.pin_memory() if device.type == "cuda" else host


def _to_device(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The 1-D int64 host tensors ``host`` on ``device``: on a GPU packed into one pinned buffer and copied at once."""
    if device.type != "cuda":
        return {name: t.to(device) for name, t in host.items()}
    packed = to_device(torch.cat(list(host.values())), device)
    return dict(zip(host, packed.split([t.numel() for t in host.values()])))
