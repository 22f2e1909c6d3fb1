"""Tree drafting (EAGLE-2's dynamic tree, as SGLang serves it): build a draft tree, and accept its longest path.

A tree of ``TreeShape(topk, depth, draft_tokens)`` grows from the root (the sequence's last token, verified anew):

- depth 1: the root's ``topk`` children, from the draft's carried distribution;
- depth d > 1: the ``topk`` best nodes of depth d - 1 (by cumulative draft log-probability, the node's score) are
  expanded, each in one batched draft forward, into ``topk`` children each;
- then the ``draft_tokens - 1`` best of all candidates (SGLang's ``--speculative-num-draft-tokens`` counts the root)
  form the tree that the target verifies in one forward, every node attending to its ancestors alone.

Children come from the draft's distribution q of their parent: at T = 0 its ``topk`` most probable tokens; otherwise
``topk`` draws without replacement (each from q with the earlier draws removed). A child's score is its parent's plus
the log-probability of its token at T = 0; when sampling, the s-th draw scores as the s-th most probable token, so that
which siblings the tree keeps (a prefix of the draws, tried in that order) never depends on what they drew, which
would bias the rule below (tested: ``tests/test_tree.py``).

Acceptance (``accept_tree``) is recursive rejection sampling (SpecInfer's multi-candidate rule, drafts drawn without
replacement): at a node with target distribution p, child i (token x, drawn from q_i) is kept with probability
``min(1, p(x) / q_i(x))``; if rejected, p becomes ``max(p - q_i, 0)`` renormalised and the next child is tried; when
none is kept, the next token is drawn from p. The emitted tokens are distributed as the target's, whatever the
tree. With topk = 1 this is the chain's rule (``acceptance.accept_batch``), uniform for uniform; at T = 0 it keeps the
child equal to the target's argmax. Everything is batched on the device: ``B`` sequences, ``N`` tree tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtp_train.runtime.device import to_device
from mtp_train.runtime.sampling import SamplingParams, draw, target_distributions


@dataclass(frozen=True)
class TreeShape:
    """``topk`` children per expanded node, ``depth`` levels, ``draft_tokens`` tokens verified (the root's
    included, as SGLang counts them)."""

    topk: int
    depth: int
    draft_tokens: int

    def __post_init__(self) -> None:
        if self.topk < 1 or self.depth < 1 or not 2 <= self.draft_tokens <= self.candidates + 1:
            raise ValueError(f"a tree of topk {self.topk}, depth {self.depth} holds 2..{self.candidates + 1} "
                             f"draft tokens, not {self.draft_tokens}")

    @property
    def candidates(self) -> int:
        """M, the nodes drafted before pruning: ``topk`` at depth 1, ``topk²`` at each deeper level."""
        return self.topk + (self.depth - 1) * self.topk**2

    @property
    def expanded(self) -> int:
        """E, the nodes whose children are drafted: the root, then ``topk`` per level above the last."""
        return 1 + (self.depth - 1) * self.topk

    @property
    def uniforms(self) -> int:
        """Uniforms per sequence and step: one per candidate's draw, one per node's test, one for the next token."""
        return self.candidates + self.draft_tokens

    def describe(self) -> str:
        return f"topk {self.topk}, depth {self.depth}, {self.draft_tokens} draft tokens"


@dataclass
class DraftTree:
    """The pruned tree of B sequences, nodes in tree order (a parent before its children; node 0 the root).

    - ``tokens [B, N]`` int64 (the root's is the sequence's last token), ``depth [B, N]`` int64 (root 0),
      ``parent [B, N]`` int64 (the root's is itself), ``children [B, N, topk]`` int64 tree indices in draw order,
      -1 where absent;
    - ``sees [B, N, N]`` bool: node i attends to node j (j is i or an ancestor of i);
    - ``q [B, N, V]`` float32: the distribution each node's children were drawn from (``None`` at T = 0).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    children: torch.Tensor
    sees: torch.Tensor
    q: torch.Tensor | None


# child_logits(level, tokens [B, K], expanded [B, K], parents [B, K], sees [B, K, level * K]) -> logits [B, K, V]
# of the K nodes expanded at depth ``level``: ``expanded`` their indices among the expanded nodes
# (1 + (level - 1) * K + i; 0 is the root), ``parents`` their parents', ``sees`` which of the draft's tree slots
# (level by level, K each) each one attends to.
ChildLogits = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Candidates:
    """Every drafted node before pruning, ``[B, M]`` each, filled level by level."""

    def __init__(self, shape: TreeShape, batch: int, device: torch.device) -> None:
        m = shape.candidates
        self.token = torch.zeros((batch, m), dtype=torch.int64, device=device)
        self.score = torch.full((batch, m), float("-inf"), device=device)
        self.parent = torch.zeros((batch, m), dtype=torch.int64, device=device)  # its parent's expanded index
        self.sibling = torch.zeros((batch, m), dtype=torch.int64, device=device)  # its rank among its siblings
        self.expanded = torch.full((batch, m), -1, dtype=torch.int64, device=device)  # its own expanded index
        levels = [1] * shape.topk + [d for d in range(2, shape.depth + 1) for _ in range(shape.topk**2)]
        self.depth = to_device(torch.tensor(levels), device)  # [M]: depth 1, then topk² per deeper level
        self.count = 0

    def add(self, token: torch.Tensor, score: torch.Tensor, parent: torch.Tensor) -> slice:
        """Append ``[B, P, K]`` children of P expanded nodes (``parent [B, P]``), the next level's."""
        batch, p, k = token.shape
        where = slice(self.count, self.count + p * k)
        self.token[:, where] = token.view(batch, -1)
        self.score[:, where] = score.view(batch, -1)
        self.parent[:, where] = parent[:, :, None].expand(-1, -1, k).reshape(batch, -1)
        self.sibling[:, where] = torch.arange(k, device=token.device).repeat(p)
        self.count += p * k
        return where


def _children(logits: torch.Tensor, score: torch.Tensor, k: int, params: list[SamplingParams],
              u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The children of P nodes per sequence: ``logits [B, P, V]``, ``score [B, P]``, ``u [B, P * K]`` -> tokens and
    scores ``[B, P, K]`` and the distributions ``[B, P, V]`` they were drawn from (``None`` at T = 0)."""
    batch, p, vocab = logits.shape
    if u is None:
        logits = logits.float()
        top = logits.topk(k, dim=-1)  # log-probabilities: the top logits less the logsumexp
        return top.indices, score[..., None] + top.values - logits.logsumexp(-1, keepdim=True), None
    rows = [params[b] for b in range(batch) for _ in range(p)]
    q = target_distributions(logits.reshape(batch * p, vocab), rows).view(batch, p, vocab)
    left, tokens = q.clone(), []
    for s in range(k):  # without replacement: each draw from what the earlier ones left
        token = draw(left.view(-1, vocab), u.view(batch, p, k)[:, :, s].reshape(-1)).view(batch, p)
        tokens.append(token)
        left.scatter_(2, token[..., None], 0.0)
    # The s-th draw scores as the s-th most probable token would (what it is at T = 0), whatever was drawn: which
    # siblings the tree keeps must not depend on their own values, or trying them in order would bias the output.
    return torch.stack(tokens, -1), score[..., None] + q.topk(k, dim=-1).values.log(), q


def build_tree(root: torch.Tensor, first_logits: torch.Tensor, child_logits: ChildLogits, shape: TreeShape,
               params: list[SamplingParams], u: torch.Tensor | None) -> DraftTree:
    """Draft the trees of B sequences: ``root [B]`` their last tokens, ``first_logits [B, V]`` the draft's logits
    for the token after it, ``u [B, shape.uniforms]`` (``None``: every request greedy)."""
    batch, k, device = root.shape[0], shape.topk, root.device
    cand = _Candidates(shape, batch, device)
    qs = [] if u is not None else None  # the expanded nodes' distributions, [B, V] or [B, K, V] per level
    sees = torch.zeros((batch, shape.expanded, (shape.depth - 1) * k), dtype=torch.bool, device=device)
    token, score, q = _children(first_logits[:, None], torch.zeros((batch, 1), device=device), k, params,
                                None if u is None else u[:, :k])
    level = cand.add(token, score, torch.zeros((batch, 1), dtype=torch.int64, device=device))
    if qs is not None:
        qs.append(q)
    rows = torch.arange(batch, device=device)[:, None]
    for depth in range(1, shape.depth):
        order = torch.sort(cand.score[:, level], dim=1, descending=True, stable=True).indices[:, :k]
        chosen = order + level.start  # [B, K] candidate indices expanded at this depth
        expanded = 1 + (depth - 1) * k + torch.arange(k, device=device)[None].expand(batch, -1)
        cand.expanded[rows, chosen] = expanded
        own = torch.zeros((batch, k, sees.shape[2]), dtype=torch.bool, device=device)
        own[:, :, (depth - 1) * k : depth * k] = torch.eye(k, dtype=torch.bool, device=device)
        sees[rows, expanded] = sees[rows, cand.parent[rows, chosen]] | own
        logits = child_logits(depth, cand.token[rows, chosen], expanded, cand.parent[rows, chosen],
                              sees[rows, expanded][..., : depth * k])
        draws = None if u is None else u[:, k + (depth - 1) * k * k : k + depth * k * k]
        token, score, q = _children(logits, cand.score[rows, chosen], k, params, draws)
        level = cand.add(token, score, expanded)
        if qs is not None:
            qs.append(q)
    return _prune(root, cand, shape, qs)


def _prune(root: torch.Tensor, cand: _Candidates, shape: TreeShape, qs: list[torch.Tensor] | None) -> DraftTree:
    """The ``draft_tokens - 1`` best candidates and the root as a tree. A parent scores at least as high as its
    child and an earlier sibling as a later one, and ties go to the earlier candidate, so the kept set is closed
    under parents and under earlier siblings."""
    batch, device, n = root.shape[0], root.device, shape.draft_tokens
    kept = torch.sort(cand.score, dim=1, descending=True, stable=True).indices[:, : n - 1].sort(dim=1).values
    rows = torch.arange(batch, device=device)[:, None]
    node_of = torch.zeros_like(cand.token)  # candidate -> tree index (0 where pruned)
    node_of[rows, kept] = torch.arange(1, n, device=device)[None].expand(batch, -1)
    # expanded index -> tree index (the root's 0), by a scatter that sends the unexpanded to a dropped last column
    column = torch.where(cand.expanded >= 0, cand.expanded, shape.expanded)
    node_of_expanded = torch.zeros((batch, shape.expanded + 1), dtype=torch.int64, device=device)
    node_of_expanded = node_of_expanded.scatter_(1, column, node_of)[:, : shape.expanded]
    parent = torch.cat([torch.zeros((batch, 1), dtype=torch.int64, device=device),
                        node_of_expanded.gather(1, cand.parent.gather(1, kept))], 1)
    depth = torch.cat([torch.zeros((batch, 1), dtype=torch.int64, device=device), cand.depth[kept]], 1)
    children = torch.full((batch, n, shape.topk), -1, dtype=torch.int64, device=device)
    children[rows, parent[:, 1:], cand.sibling.gather(1, kept)] = torch.arange(1, n, device=device)[None]
    sees = torch.eye(n, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    for _ in range(shape.depth):  # each pass adds one more generation of ancestors
        sees |= sees.gather(1, parent[..., None].expand(-1, -1, n))
    q = None
    if qs is not None:  # the distribution each node was expanded from, by its expanded index
        by_expanded = torch.cat([qs[0]] + [x for x in qs[1:]], 1)  # [B, E, V]
        expanded_of = torch.zeros((batch, n), dtype=torch.int64, device=device)
        expanded_of[:, 1:] = cand.expanded.gather(1, kept).clamp(min=0)
        q = by_expanded.gather(1, expanded_of[..., None].expand(-1, -1, by_expanded.shape[2]))
    tokens = torch.cat([root[:, None], cand.token.gather(1, kept)], 1)
    return DraftTree(tokens=tokens, depth=depth, parent=parent, children=children, sees=sees, q=q)


def accept_tree(tree: DraftTree, levels: int, target_probs: torch.Tensor, depth: torch.Tensor,
                u_accept: torch.Tensor, u_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over B trees (the module's rule).

    ``levels`` the tree's depth, ``target_probs [B, N, V]`` the target's distribution after each node, ``depth [B]``
    how deep each sequence's
    tree may be accepted (fewer where its positions run out), ``u_accept [B, N - 1]`` node i's uniform at column
    i - 1, ``u_next [B]`` float64 -> ``accepted [B]`` (the path's length), ``next_token [B]`` and ``leaf [B]``
    (the tree index of the path's last node, 0 the root).
    """
    batch, n, _ = target_probs.shape
    rows = torch.arange(batch, device=target_probs.device)
    cur = torch.zeros(batch, dtype=torch.int64, device=rows.device)
    accepted, done = torch.zeros_like(cur), torch.zeros(batch, dtype=torch.bool, device=rows.device)
    p = target_probs[:, 0].double()
    u = torch.cat([torch.zeros_like(u_accept[:, :1]), u_accept], 1)  # by tree index
    for level in range(1, levels + 1):
        moved = torch.zeros_like(done)
        left = tree.q[rows, cur].double()
        for s in range(tree.children.shape[2]):
            child = tree.children[rows, cur, s]
            has = (child > 0) & ~done & ~moved & (level <= depth)
            at = child.clamp(min=0)
            x = tree.tokens[rows, at][:, None]
            q_s = left if s == 0 else left / left.sum(-1, keepdim=True).clamp(min=1e-300)
            px, qx = p.gather(1, x)[:, 0], q_s.gather(1, x)[:, 0]
            keep = has & (qx > 0) & (u[rows, at] * qx < px)
            residual = (p - q_s).clamp(min=0)
            total = residual.sum(-1, keepdim=True)
            p = torch.where((has & ~keep)[:, None], torch.where(total > 0, residual / total.clamp(min=1e-300), p), p)
            left = torch.where(has[:, None], left.scatter(1, x, 0.0), left)
            cur, moved = torch.where(keep, child, cur), moved | keep
        done |= ~moved
        p = torch.where(moved[:, None], target_probs[rows, cur].double(), p)
        accepted += moved.long()
    return accepted, draw(p, u_next), cur


def accept_tree_greedy(tree: DraftTree, levels: int, target_argmax: torch.Tensor, depth: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accept_tree`` for greedy targets: ``target_argmax [B, N]`` -> ``accepted``, ``next_token``, ``leaf``
    ``[B]``: the deepest node whose every token, its own and its ancestors', is the target's argmax after its
    parent (siblings are distinct, so the path is one)."""
    match = tree.tokens == target_argmax.gather(1, tree.parent)
    match[:, 0] = True
    match &= tree.depth <= depth[:, None]
    good = match
    for _ in range(levels):
        good = match & good.gather(1, tree.parent)
    reach = torch.where(good, tree.depth, -1)
    accepted = reach.max(1).values
    leaf = (reach == accepted[:, None]).long().argmax(1)
    return accepted, target_argmax.gather(1, leaf[:, None])[:, 0], leaf


def path_of(tree: DraftTree, leaf: torch.Tensor, levels: int) -> torch.Tensor:
    """``[B, levels + 1]`` tree indices from the root to ``leaf [B]`` by depth; past the leaf's depth, the leaf."""
    path = leaf[:, None].repeat(1, levels + 1)
    cur = leaf
    for _ in range(levels + 1):
        path.scatter_(1, tree.depth.gather(1, cur[:, None]), cur[:, None])
        cur = tree.parent.gather(1, cur[:, None])[:, 0]
    return path
