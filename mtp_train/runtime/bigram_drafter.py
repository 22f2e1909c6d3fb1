"""The bigram baseline draft: each token's most frequent successor in the training data."""

from __future__ import annotations

import torch

from mtp_train.runtime.device import to_device
from mtp_train.runtime.drafters import Feed, TokenDrafter
from mtp_train.runtime.engine import Engine


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

    def tree_forward(self, seqs, level, tokens, hidden, sees):
        logits = self._successor_logits(tokens.reshape(-1)).view(*tokens.shape, -1)
        return logits, logits

    def _successor_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [N]`` -> ``[N, V]``: 0 at each id's successor, -inf elsewhere."""
        logits = torch.full((ids.numel(), self.engine.cfg.vocab_size), float("-inf"), device=ids.device)
        return logits.scatter_(1, self.successor[ids][:, None], 0.0)

    def forward(self, feeds: list[Feed]) -> None:
        if not self.leader:
            return
        if not feeds:
            return
        device, last = self.engine.device, [f.tokens[-1:] for f in feeds]
        ids = torch.cat(last) if isinstance(last[0], torch.Tensor) else to_device(torch.tensor(last).view(-1), device)
        logits = self._successor_logits(ids)
        for i, f in enumerate(feeds):
            self.carried[f.seq.request_id] = (logits[i], logits[i])
