"""Drafts for speculative decoding, each on a page allocator of its own: a draft model, or a trained head (MTP, EAGLE,
EAGLE-3, P-EAGLE, DFlash) over the target's states (the bigram baseline: ``bigram_drafter``).

Between steps, for a running sequence with n tokens:

- the target holds K/V for positions 0..n-2 (the last token is pending), as in plain decoding;
- a **draft model** holds K/V for 0..n-1 and carries the logits that predict t_n;
- a **head** holds K/V for 0..n-2 (its position i read the target's state at i and the token t_{i+1}: the token
  buffer is shifted one step left of the hidden states), carries the logits that predict t_n, and carries its
  state at n-2 that the chain feeds back as the next hidden input (its output, or its output after its final norm:
  ``feedback``). An EAGLE-3 head reads ``fc`` of three layers' states (``capture``) instead of the last layer's;
- a **block** draft (DFlash) holds the context K/V of 0..n-2, made from the target's states alone, and carries
  nothing: each step one non-causal forward over ``[t_{n-1}, mask x k]`` at n-1..n-1+k drafts all k (its K/V
  written at those positions, which the next sync overwrites with the verified context);
- a **P-EAGLE** head holds what an EAGLE-3 head holds, its rows written by the step's one causal forward over the
  rows since the last and k - 1 masks after them (the masks' K/V overwritten as a block's are).

Under tensor parallelism only the leader rank drafts; the other ranks keep identical page bookkeeping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from mtp_train.errors import UserError
from mtp_train.heads.base import DraftHead
from mtp_train.heads.dflash import DFlashHead
from mtp_train.models.parts import Linear
from mtp_train.models.transformer import Transformer
from mtp_train.runtime.attention import select_backend
from mtp_train.runtime.batch import TreeMask, build_batch
from mtp_train.runtime.device import to_device
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.kv_cache import KVPool, PageAllocator
from mtp_train.runtime.sequence import Sequence
from mtp_train.runtime.small_batch import tune
from mtp_train.runtime.tree import ChildLogits, TreeShape


@dataclass
class Feed:
    """One sequence's draft forward: ``tokens`` at positions ``start..`` (ids on the host, or ``[len]`` int64 on
    the device: a draft chain's own samples); ``hidden [len, H]`` for a head."""

    seq: Sequence
    start: int
    tokens: list[int] | torch.Tensor
    hidden: torch.Tensor | None = None


class Drafter:
    """A draft with its own K/V pool and page allocator (``seq.draft_pages``), as many pages as the target's.

    Under tensor parallelism only the leader rank holds the draft's weights on the GPU and its K/V pool
    (``kv`` is None elsewhere); every rank keeps the same page bookkeeping.
    """

    name = ""  # what reports call it: "draft_target", "mtp", "eagle", "eagle3", "dflash" or "bigram"
    capture: tuple[int, ...] = ()  # target layers whose outputs ``features`` reads (0-based), besides the last one
    parallel = False  # drafts k tokens in one forward (``block_logits``), not a chain over carried logits
    forwards_per_step: int | None = None  # draft forwards per speculative step; None: one per drafted token
    defers_writes = False  # ``forward`` keeps its feeds for the next draft forward instead of running one

    def __init__(self, engine: Engine, num_layers: int, dtype: torch.dtype, sliding_window: int | None) -> None:
        self.engine = engine
        self.window = sliding_window  # keys above a query's position minus the window only: pages below are given back
        self.allocator = PageAllocator(engine.allocator.num_pages, engine.allocator.page_size, sliding_window is not None)
        self.leader = engine.tp.rank == 0
        cfg = dataclasses.replace(self.kv_config(), num_layers=num_layers)
        self.kv = KVPool(cfg, self.allocator, dtype, engine.device) if self.leader else None
        self.backend = select_backend(engine.backend_name, engine.device, sliding_window, dtype,
                                      torch_only=cfg.torch_only, head_dim=cfg.head_dim)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.carried: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request id -> (logits [V], hidden [H])

    def kv_config(self):
        raise NotImplementedError

    def valid(self, seq: Sequence) -> int:
        """Positions the draft holds between steps for a sequence of n tokens (n, or n-1 for a head)."""
        raise NotImplementedError

    def features(self, hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """What the draft reads of a target forward: its pre-norm last-layer ``hidden [T, H]`` and the outputs of
        the ``capture`` layers -> ``[T, H]`` rows that ``feed`` hands out (the pre-norm hidden by default)."""
        return hidden

    def feed(self, seq: Sequence, draft_valid: int, target_start: int, target_hidden: torch.Tensor) -> Feed:
        """What the draft must forward, holding ``draft_valid`` positions, once the target has processed
        positions ``target_start..`` (their ``features``, ``target_hidden [m, H]``) and the sequence has grown."""
        raise NotImplementedError

    def chain_input(self, seq: Sequence, token: torch.Tensor) -> Feed:
        """The next chain forward after drafting ``token [1]`` int64 (on the device)."""
        raise NotImplementedError

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None, plan) -> torch.Tensor:
        """Forward packed inputs; returns the output hidden ``[T, H]`` (its K/V written into the pages)."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The output hidden ``[T, H]`` -> what the next chained forward reads (a head's ``feedback_state``)."""
        return out

    def forward(self, feeds: list[Feed]) -> None:
        """Run ``feeds`` (pages already reserved) and carry each one's logits and hidden at its last position."""
        if not feeds or not self.leader:
            return
        meta = build_batch([f.tokens for f in feeds], [f.start for f in feeds], [f.seq.draft_pages.pages for f in feeds],
                           self.allocator.page_size, self.engine.device)
        hidden = torch.cat([f.hidden for f in feeds]) if feeds[0].hidden is not None else None
        out = self.run(meta.tokens, meta.positions, hidden, self.backend.plan(meta, *self.heads))
        last = out[meta.last_token_index]
        logits, fed_back = self.logits(last), self.feedback(last)
        for i, f in enumerate(feeds):
            self.carried[f.seq.request_id] = (logits[i], fed_back[i])

    def tree_start(self, batch: list[tuple[Sequence, int]], shape: TreeShape) -> tuple[torch.Tensor, ChildLogits]:
        """Leader: the logits ``[B, V]`` of each sequence's first draft (carried) and the forwards of its tree's
        expanded nodes (``tree.build_tree``), each reading its parent's output (the root's: the carried one)."""
        seqs = [seq for seq, _ in batch]
        first = torch.stack([self.carried[s.request_id][0] for s in seqs])
        root = torch.stack([self.carried[s.request_id][1] for s in seqs])
        fed_back = root.new_zeros((len(seqs), shape.expanded, root.shape[-1]))
        fed_back[:, 0] = root
        rows = torch.arange(len(seqs), device=root.device)[:, None]

        def child_logits(level, tokens, expanded, parents, sees):
            logits, out = self.tree_forward(seqs, level, tokens, fed_back[rows, parents], sees)
            fed_back[rows, expanded] = out
            return logits

        return first, child_logits

    def tree_forward(self, seqs: list[Sequence], level: int, tokens: torch.Tensor, hidden: torch.Tensor,
                     sees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the K tree nodes per sequence expanded at depth ``level``: ``tokens [B, K]``, their
        parents' outputs ``hidden [B, K, H]``, at the slots after the K of each shallower level (past what the
        draft holds), the position after their parents', attending to the draft's context and the slots ``sees
        [B, K, level * K]`` names -> their logits ``[B, K, V]`` and what their children read ``[B, K, H]``."""
        batch, k = tokens.shape
        valid = [self.valid(seq) for seq in seqs]
        last = self.engine.cfg.max_positions - 1  # (past a sequence's last position, its nodes are never accepted)
        positions = torch.tensor([min(v + level - 1, last) for v in valid]).repeat_interleave(k)
        meta = build_batch(list(tokens), [v + (level - 1) * k for v in valid], [s.draft_pages.pages for s in seqs],
                           self.allocator.page_size, self.engine.device, positions, TreeMask(valid, list(sees)))
        out = self.run(meta.tokens, meta.positions, hidden.flatten(0, 1), self.backend.plan(meta, *self.heads))
        return self.logits(out).view(batch, k, -1), self.feedback(out).view(batch, k, -1)


class TokenDrafter(Drafter):
    """A draft that reads tokens only (no target hidden states): it holds every token of the sequence and
    catches up by feeding the ones it has not seen."""

    def valid(self, seq: Sequence) -> int:
        return len(seq.tokens)

    def feed(self, seq: Sequence, draft_valid: int, target_start: int, target_hidden: torch.Tensor) -> Feed:
        return Feed(seq, draft_valid, seq.tokens[draft_valid:])

    def chain_input(self, seq: Sequence, token: torch.Tensor) -> Feed:
        return Feed(seq, 0, token)


def check_draft_vocab(draft: int, target: int) -> None:
    """Refuse a draft model whose vocabulary (``draft`` ids) is not the target's (``target``): decided by the configs
    of the two checkpoints the recipe names, so ``mtp_train.pipeline.check_recipe`` makes it before any stage runs."""
    if draft != target:
        raise UserError(f"draft model vocab {draft} differs from the target's {target}; a draft must share the "
                        "target's tokenizer")


class DraftModelDrafter(TokenDrafter):
    """Draft-target: a small LLM of any supported family, sharing the target's tokenizer."""

    name = "draft_target"

    def __init__(self, engine: Engine, model: Transformer) -> None:
        check_draft_vocab(model.cfg.vocab_size, engine.cfg.vocab_size)
        self.model = model
        if engine.small_batch_layout:  # the draft's weights get the target's small-batch layout too
            tune(model)
        super().__init__(engine, model.cfg.num_layers, model.output.weight.dtype, model.cfg.sliding_window)

    def kv_config(self):
        return self.model.cfg

    def run(self, tokens, positions, hidden, plan):
        return self.model(tokens, positions, plan, self.kv.layers)[0]

    def logits(self, out):
        return self.model.logits(out)


def _rows_of(output: nn.Linear, ids: torch.Tensor) -> Linear:
    """A bias-free ``Linear`` over the rows ``ids [N]`` of ``output``'s weight: ``[T, H] -> [T, N]``."""
    rows = Linear(output.in_features, ids.numel(), bias=False, device=output.weight.device, dtype=output.weight.dtype)
    rows.weight = nn.Parameter(output.weight.detach()[ids].contiguous(), requires_grad=False)
    return rows


class HeadDrafter(Drafter):
    """MTP, EAGLE or EAGLE-3: a trained head over the target's hidden states and embedding, drafting with the
    frozen lm_head (MTP, EAGLE) or its own over a draft vocabulary (EAGLE-3)."""

    def __init__(self, engine: Engine, head: DraftHead, name: str | None = None, vocab: torch.Tensor | None = None):
        """``vocab [N]``: the ids an ``mtp``/``eagle`` head may draft (``eval.draft_vocab``): logits from those
        lm_head rows, -inf elsewhere. An ``eagle3`` head drafts from its own vocabulary (``draft_ids``) instead."""
        self.name = name or head.spec.kind  # "mtp", "eagle", "eagle3", or "target_mtp" (a checkpoint's own MTP layer)
        self.head = (head.to(engine.device, engine.model.output.weight.dtype) if engine.tp.rank == 0 else head).eval()
        self.target = engine.model
        spec = head.spec
        self.own_vocab = spec.kind == "eagle3"
        self.capture = tuple(k - 1 for k in spec.aux_layers)  # eagle3, dflash: layer k - 1's output enters block k
        if self.own_vocab:
            self.vocab = self.head.draft_ids if spec.draft_vocab < engine.cfg.vocab_size else None
            self.vocab_head = self.head.lm_head  # [N, H], draft id order = ascending target ids
        else:
            self.vocab = None if vocab is None else vocab.to(engine.device)
            self.vocab_head = None if vocab is None else _rows_of(engine.model.output, self.vocab)
        if engine.small_batch_layout:  # the head's own weights get the target's small-batch layout too
            tune(self.head if self.vocab_head is None else nn.ModuleList([self.head, self.vocab_head]))
        super().__init__(engine, len(head.layers), engine.model.output.weight.dtype, spec.window or None)

    def kv_config(self):
        return self.head.layer_config()

    def valid(self, seq: Sequence) -> int:
        return len(seq.tokens) - 1

    def features(self, hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        if not self.leader:  # (it drafts nothing)
            return hidden
        if self.capture:  # eagle3's fc, dflash's fc and hidden_norm of the aux layers' states
            return self.head.project(torch.cat(captured, dim=-1))
        return self.target.norm(hidden) if self.head.spec.hidden_input == "post_norm" else hidden

    def feed(self, seq: Sequence, draft_valid: int, target_start: int, target_hidden: torch.Tensor) -> Feed:
        assert draft_valid == target_start, "the head and the target hold the same positions"
        m = target_hidden.shape[0]  # position i reads h_i and t_{i+1}
        return Feed(seq, target_start, seq.tokens[target_start + 1 : target_start + 1 + m], target_hidden)

    def chain_input(self, seq: Sequence, token: torch.Tensor) -> Feed:
        return Feed(seq, 0, token, self.carried[seq.request_id][1][None])

    def run(self, tokens, positions, hidden, plan):
        return self.head.run(self.target.embed(tokens), hidden, positions, plan, self.kv.layers)

    def logits(self, out):
        x = self.head.lm_head_input(out)
        if self.vocab_head is None:
            return self.target.output(x).float()
        rows = self.vocab_head(x).float()
        if self.vocab is None:  # an eagle3 head over the whole vocabulary
            return rows
        full = x.new_full((x.shape[0], self.target.cfg.vocab_size), float("-inf"), dtype=torch.float32)
        return full.index_copy_(1, self.vocab, rows)

    def feedback(self, out):
        return self.head.feedback_state(out)


class BlockDrafter(HeadDrafter):
    """DFlash: the target's states at the head's aux layers become context K/V in the draft's pages; each step
    ``block_logits`` drafts k tokens in one non-causal forward, which first writes, layer by layer, the context rows
    the steps since the last block brought (``forward`` keeps them until then, attending nothing): one draft forward
    per step."""

    parallel = True
    forwards_per_step = 1  # the block, with the context's write folded in
    defers_writes = True  # ``forward`` only keeps the rows: the step's draft forward is the block's

    def __init__(self, engine: Engine, head: DraftHead, name: str | None = None, vocab: torch.Tensor | None = None):
        super().__init__(engine, head, name, vocab)
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # request id -> (first position, rows [n, H]) unwritten

    def forward(self, feeds: list[Feed]) -> None:
        """Keep each feed's context rows (``hidden``, from position ``start``; the draft's pages reserved) for the
        next block of its sequence; rows kept earlier from ``start`` on are replaced (the draft was truncated)."""
        if not self.leader:
            return
        for f in feeds:
            first, rows = self.pending.get(f.seq.request_id, (f.start, f.hidden[:0]))
            kept = rows[: max(0, f.start - first)]
            self.pending[f.seq.request_id] = (first if len(kept) else f.start, torch.cat([kept, f.hidden]))

    def _context(self, seqs: list[Sequence]):
        """The rows kept for ``seqs`` (taken) as ``(rows [C, H], positions [C], write plan)``; None when none are.
        Each sequence's pages are cut to the rows' end in the plan, so that its lengths are the context's."""
        taken = [(seq, *self.pending.pop(seq.request_id)) for seq in seqs if seq.request_id in self.pending]
        if not taken:
            return None
        page = self.allocator.page_size
        meta = build_batch([list(range(len(rows))) for _, _, rows in taken], [first for _, first, _ in taken],
                           [seq.draft_pages.pages[: -(-(first + len(rows)) // page)] for seq, first, rows in taken],
                           page, self.engine.device)
        return torch.cat([rows for _, _, rows in taken]), meta.positions, self.backend.plan(meta, *self.heads)

    def block_logits(self, batch: list[tuple[Sequence, int]], k: int) -> torch.Tensor:
        """Leader: one forward over each sequence's block ``[t_{n-1}, mask x k_b]`` (pages reserved) -> the logits
        of its drafts ``[B, k, V]`` float32 (row b's first ``k_b``; the rest repeat its last, never read)."""
        size = self.head.spec.block_size  # (the recipe refuses a longer draft; this catches a head trained otherwise)
        if k >= size:
            raise UserError(f"eval.k: k = {k} drafts past what the dflash head trained (head.block_size {size}: draft "
                            f"positions 1..{size - 1}); lower eval.k (and eval.trees' depth) to at most {size - 1}")
        seqs = [seq for seq, _ in batch]
        blocks = [[seq.tokens[-1]] + [self.head.spec.mask_token_id] * k_b for seq, k_b in batch]
        meta = build_batch(blocks, [self.valid(seq) for seq in seqs], [seq.draft_pages.pages for seq in seqs],
                           self.allocator.page_size, self.engine.device)
        bounds = meta.host_qo_indptr.tolist()
        first = to_device(torch.tensor(bounds[:-1]), self.engine.device)
        embeds = self.head.mask_embedding.to(self.target.output.weight.dtype).expand(meta.tokens.numel(), -1).clone()
        embeds[first] = self.target.embed(meta.tokens[first])
        context = self._context(seqs)  # planned first: FlashInfer's wrapper keeps the last plan, the block's; the
        # context's plan only writes (paged append, from its own indices)
        out = self.head.run(embeds, None, meta.positions, self.backend.plan(meta, *self.heads, causal=False),
                            self.kv.layers, context)
        rows = [[bounds[b] + min(j + 1, k_b) for j in range(k)] for b, (_, k_b) in enumerate(batch)]
        return self.logits(out[to_device(torch.tensor(rows), out.device).view(-1)]).view(len(batch), k, -1)

    def tree_start(self, batch: list[tuple[Sequence, int]], shape: TreeShape) -> tuple[torch.Tensor, ChildLogits]:
        """One block of ``shape.depth`` drafts: every node at depth d draws its children from the block's position
        d + 1 (the block's drafts do not depend on each other), so the tree costs this one forward."""
        block = self.block_logits(batch, shape.depth)  # [B, depth, V]
        return block[:, 0], lambda level, tokens, *_: block[:, level, None].expand(-1, tokens.shape[1], -1)


class ParallelDrafter(BlockDrafter):
    """The rows the steps since the last draft brought (``forward`` keeps them: each verified position i's
    ``t_{i+1}`` and ``fc`` of the target's states) run in one causal forward with k - 1 mask positions after them
    (``mask_token_id``'s embedding, the head's ``mask_state``): the last verified row drafts the first token and
    mask position j the (j+1)-th. The rows' keys and values stay in the draft's pages; the masks' are overwritten by
    the next step's rows at the same positions."""

    def block_logits(self, batch: list[tuple[Sequence, int]], k: int) -> torch.Tensor:
        """Leader: one forward over each sequence's kept rows and ``k_b - 1`` masks (pages reserved) -> the logits of
        its drafts ``[B, k, V]`` float32 (row b's first ``k_b``; the rest repeat its last, never read)."""
        drafts = self.head.spec.parallel_drafts
        if k > drafts:  # (the recipe refuses a longer draft; this catches a head trained otherwise)
            raise UserError(f"eval.k: k = {k} drafts past the {drafts} a P-EAGLE head drafts in one forward "
                            f"(head.parallel_drafts); lower eval.k (and eval.trees' depth) to at most {drafts}")
        mask_id, mask = self.head.spec.mask_token_id, self.head.mask_state()  # [1, H]
        tokens, starts, hidden, kept = [], [], [], []
        for seq, k_b in batch:
            first, rows = self.pending.pop(seq.request_id)
            masks = max(0, k_b - 1)
            tokens.append(list(seq.tokens[first + 1 : first + 1 + len(rows)]) + [mask_id] * masks)
            starts.append(first)
            hidden += [rows, mask.expand(masks, -1)]
            kept.append(len(rows))
        seqs = [seq for seq, _ in batch]
        meta = build_batch(tokens, starts, [seq.draft_pages.pages for seq in seqs], self.allocator.page_size,
                           self.engine.device)
        out = self.head.run(self.target.embed(meta.tokens), torch.cat(hidden), meta.positions,
                            self.backend.plan(meta, *self.heads), self.kv.layers)
        bounds = meta.host_qo_indptr.tolist()
        rows = [[bounds[b] + n - 1 + min(j, max(0, k_b - 1)) for j in range(k)]
                for b, ((_, k_b), n) in enumerate(zip(batch, kept))]
        return self.logits(out[to_device(torch.tensor(rows), out.device).view(-1)]).view(len(batch), k, -1)


def head_drafter(engine: Engine, head: DraftHead, vocab: torch.Tensor | None = None, name: str | None = None
                 ) -> HeadDrafter:
    """The drafter of a trained head: a block drafter for a dflash head, a parallel one for a P-EAGLE head, a chain
    for the others."""
    drafter = BlockDrafter if isinstance(head, DFlashHead) else ParallelDrafter if head.spec.parallel_drafts else HeadDrafter
    return drafter(engine, head, name, vocab)
