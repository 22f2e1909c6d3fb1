"""Speculative decoding with a draft tree (:mod:`mtp_train.runtime.tree`): the chain's decoder, one step changed.

A tree step, for a running sequence with n tokens:

1. **draft**: ``build_tree`` over the draft (``Drafter.tree_start``): the carried logits give depth 1, then one
   batched forward per deeper level over its ``topk`` expanded nodes, written at the draft's slots past its context
   (a block draft: all levels from its one block forward);
2. **verify**: the target forwards the tree's N tokens (root ``t_{n-1}`` first) at slots n-1..n-2+N, each at
   position n-1 + its depth and attending to the context and its own ancestors (``TreeMask``);
3. **accept** (``accept_tree``, ``accept_tree_greedy``) the longest path; the K/V of its nodes moves to the slots
   n..n-1+a behind the root, and the target's pages are truncated to n + a: the rejected branches' K/V is freed;
4. the draft re-syncs over the path's verified states as after a chain step, which also frees its tree's slots.

Under tensor parallelism the leader drafts and decides; the tree (tokens, depths, mask) and the decisions reach
the other ranks by broadcast. At topk = 1 a tree is the chain: the same drafts, verify and decisions.
"""

from __future__ import annotations

import torch

from mtp_train.runtime.clock import RegionClock
from mtp_train.runtime.device import to_device
from mtp_train.runtime.drafters import Drafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import target_distributions, uniforms
from mtp_train.runtime.scheduler import Scheduler
from mtp_train.runtime.speculative import Batch, SpeculativeDecoder
from mtp_train.runtime.tree import (DraftTree, TreeShape, accept_tree, accept_tree_greedy, build_tree, path_of)
from mtp_train.runtime.batch import TreeMask


class TreeDecoder(SpeculativeDecoder):
    """``SpeculativeDecoder`` whose steps draft and verify a tree of ``shape``; k is its depth."""

    def __init__(self, engine: Engine, drafter: Drafter, shape: TreeShape) -> None:
        super().__init__(engine, drafter, shape.depth)
        self.shape = shape

    def _slots(self, k: int) -> tuple[int, int]:
        """The tree's N tokens in the target; in the draft, its levels' K slots each, or the re-sync's k + 1."""
        shape = self.shape
        return shape.draft_tokens, max((shape.depth - 1) * shape.topk, shape.depth + 1)

    def _draft(self, batch: Batch, u: torch.Tensor | None, clock: RegionClock) -> DraftTree:
        """Leader: the batch's trees, their draft forwards timed and counted."""
        clock.start("draft")
        shape, seqs = self.shape, [seq for seq, _ in batch]
        root = to_device(torch.tensor([seq.tokens[-1] for seq in seqs]), self.engine.device)
        first, child_logits = self.drafter.tree_start(batch, shape)
        tree = build_tree(root, first, child_logits, shape, [seq.params for seq in seqs], u)
        clock.stop("draft")
        self.timings.draft_forwards += 1 if self.drafter.parallel else shape.depth - 1
        return tree

    def _share(self, tree: DraftTree | None, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree's ``tokens``, ``depth`` ``[B, N]`` and ``sees [B, N, N]`` on every rank (the leader's)."""
        n, device = self.shape.draft_tokens, self.engine.device
        if tree is None:
            packed = torch.zeros((batch, n * (n + 2)), dtype=torch.int64, device=device)
        else:
            packed = torch.cat([tree.tokens, tree.depth, tree.sees.flatten(1).long()], 1)
        packed = self.engine.tp.broadcast(packed)
        return packed[:, :n], packed[:, n : 2 * n], packed[:, 2 * n :].view(batch, n, n).bool()

    def _decide(self, batch: Batch, tree: DraftTree, logits: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """Leader: ``[B, 4 + 3D]`` int64 on the device: accepted, the next token, the path's drafts ``[D]``, the
        target's argmax along the path ``[D + 1]`` and the path's tree indices ``[D + 1]`` (root first)."""
        shape = self.shape
        depth = to_device(torch.tensor([k_b for _, k_b in batch]), logits.device)
        own = logits.argmax(-1)  # [B, N]
        if u is None:
            accepted, token, leaf = accept_tree_greedy(tree, shape.depth, own, depth)
        else:
            params = [seq.params for seq, _ in batch for _ in range(shape.draft_tokens)]
            p = target_distributions(logits.flatten(0, 1), params).view(logits.shape)
            m = shape.candidates
            accepted, token, leaf = accept_tree(tree, shape.depth, p, depth, u[:, m : m + shape.draft_tokens - 1],
                                                u[:, m + shape.draft_tokens - 1])
        path = path_of(tree, leaf, shape.depth)
        return torch.cat([accepted[:, None], token[:, None], tree.tokens.gather(1, path)[:, 1:], own.gather(1, path),
                          path], 1)

    def _spec_step(self, scheduler: Scheduler, clock: RegionClock) -> bool:
        engine, shape = self.engine, self.shape
        batch = self._reserve(scheduler)
        if not batch:
            return False
        greedy = all(seq.params.greedy for seq, _ in batch)
        u = None if greedy else to_device(uniforms([seq.generator for seq, _ in batch], shape.uniforms), engine.device)
        tree = self._draft(batch, u, clock) if self.drafter.leader else None
        tokens, depth, sees = self._share(tree, len(batch))
        n = shape.draft_tokens
        context = [seq.cached - n for seq, _ in batch]  # the root's slot: every node sees the slots before it
        last = engine.cfg.max_positions - 1  # (nodes past a sequence's last position are never accepted)
        positions = (to_device(torch.tensor(context), engine.device)[:, None] + depth).clamp(max=last).view(-1)
        meta, hidden, captured = engine.forward([(seq, tokens[b]) for b, (seq, _) in enumerate(batch)],
                                                self.drafter.capture, positions, TreeMask(context, list(sees)))
        states = self.drafter.features(hidden, captured)
        if self.drafter.leader:
            decisions = self._decide(batch, tree, engine.model.logits(hidden).view(len(batch), n, -1), u)
        else:
            decisions = torch.zeros((len(batch), 4 + 3 * shape.depth), dtype=torch.int64, device=engine.device)
        rows = engine.tp.broadcast(decisions).tolist()  # the step's one wait for the device
        self._apply(scheduler, batch, rows, meta.host_qo_indptr.tolist(), states, clock)
        return True

    def _apply(self, scheduler: Scheduler, batch: Batch, rows: list[list[int]], bounds: list[int],
               states: torch.Tensor, clock: RegionClock) -> None:
        """Emit each sequence's path, pack its K/V behind the root, free the rest, and re-sync the draft."""
        engine, d = self.engine, self.shape.depth
        src: list[list[int]] = [[], []]  # (slots in each of the target's caches: KVPool.slots)
        dst: list[list[int]] = [[], []]
        feeds = []
        for b, ((seq, k_b), row) in enumerate(zip(batch, rows)):
            a, token, drafted, own, path = row[0], row[1], row[2 : 2 + d], row[2 + d : 3 + 2 * d], row[3 + 2 * d :]
            if seq.params.greedy:
                self.greedy_violations += sum(x != y for x, y in zip(drafted[:a] + [token], own))
            n = len(seq.tokens)
            if self._emit(scheduler, seq, drafted[:a], token, k_b):
                continue
            moved = [j for j in range(1, a + 1) if path[j] != j]  # node path[j], at n - 1 + path[j], goes to n - 1 + j
            for pool, (frm, to) in enumerate(zip(engine.kv.slots(seq.pages, [n - 1 + path[j] for j in moved]),
                                                 engine.kv.slots(seq.pages, [n - 1 + j for j in moved]))):
                src[pool] += frm
                dst[pool] += to
            engine.allocator.truncate(seq.pages, n + a)  # (freed pages keep their K/V until the move below)
            index = to_device(torch.tensor([bounds[b] + i for i in path[: a + 1]]), states.device)
            feeds.append(self.drafter.feed(seq, self.drafter.valid(seq) - a - 1, n - 1, states[index]))
        if src[0]:
            engine.kv.move(src, dst)
        self._sync(scheduler, feeds, clock)
