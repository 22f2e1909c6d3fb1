"""Online features (``precompute.mode: online``): the shards precompute plans, made in memory by the target when
training needs them, byte for byte what offline precompute would have stored.

An online plan is a features directory without shards: its manifests and indexes name every shard, its sequences
and their lengths as offline's do (precompute cuts the same rows the same way and records each shard with 0
bytes). ``OnlineFeatures`` reads it as ``FeatureReader`` reads stored features, with the same ``train`` and
``heldout`` tables and the same ``read_rows``, so the trainer's batch plan, masks and loss are the same. Only
where the bytes come from differs:

- token ids and loss masks: the plan's rows, read from the recipe's data (with the regenerated answers) only when
  a shard that holds them is encoded, and encoded as precompute encodes them, checked against the index's lengths
  (``mtp_train.features.planned_rows``): a rank converts the rows of its own windows, not the dataset;
- hidden states and top-K: one ``score`` of the shard's sequences (the call precompute makes per shard), made into
  a shard's tensors (``mtp_train.features.tensors``), so rounded as ``hidden_dtype`` stores them.

The trainer asks for the shards of its current windows before it reads them (``ensure``), and for the rows of the
next windows to be encoded meanwhile on a thread of their own (``prepare``); other shards are dropped, oldest
first, once the held bytes pass ``cache_bytes``. The held-out sequences are scored once, together, when scoring
starts (``bind``), so that validation needs no shard.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mtp_train.errors import UserError
from mtp_train.features.index import SequenceRef, SequenceTable, by_rank, load_indexes, sequence_table
from mtp_train.features.manifest import Manifest, target_fingerprint
from mtp_train.features.planned_rows import EncodedRows, PlannedRows, ShardEncoder
from mtp_train.features.reader import FeatureReader
from mtp_train.features.tensors import FP8, HIDDEN_DTYPES, scored_tensors
from mtp_train.features.verify import load_features_manifest
from mtp_train.io import group_by_tokens
from mtp_train.recipe import Recipe

if TYPE_CHECKING:
    from mtp_train.runtime.engine import ScoreOutput

Scorer = Callable[[list[list[int]]], "ScoreOutput"]  # token ids of sequences -> their scored features
Arrays = dict[str, np.ndarray]  # tensor name -> its bytes, rows back to back (uint8 [rows * row bytes])
TOKEN_SHARDS = 4  # shards whose token ids and masks ``load`` keeps (a scan goes shard after shard)


def open_features(recipe: Recipe) -> FeatureReader | OnlineFeatures:
    """The recipe's features: stored ones (``FeatureReader``), or an online plan (``OnlineFeatures``); refused when
    the recipe's ``precompute.mode`` is not the one they were made in."""
    root = recipe.features_dir
    online = load_features_manifest(root).online
    mode = recipe.precompute.mode
    if online != (mode == "online"):
        made = "planned for online training" if online else "stored offline"
        raise UserError(f"{root}: the features were {made}, and the recipe says precompute.mode {mode}; set it back, "
                        f"or rerun `mtp-train precompute` with precompute.mode={mode} --overwrite")
    return OnlineFeatures(root, recipe) if online else FeatureReader(root, target=recipe.target.path)


def row_layouts(manifest: Manifest) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Stored dtype and per-token row shape of each tensor a shard of ``manifest`` holds (not ``cu_seqlens``)."""
    layers, k = (len(manifest.layers), manifest.hidden_size), manifest.topk
    fp8 = manifest.hidden_dtype == HIDDEN_DTYPES["fp8"]
    layout = {"input_ids": (torch.int32, ()), "loss_mask": (torch.uint8, ()),
              "hidden": (FP8 if fp8 else torch.bfloat16, layers)}
    if fp8:
        layout["hidden_scale"] = (torch.float32, layers[:1])
    layout["logsumexp"] = (torch.float32, ())
    if k:
        layout |= {"topk_logprobs": (torch.bfloat16, (k,)), "topk_ids": (torch.int32, (k,)),
                   "tail_logprob": (torch.float32, ())}
    return layout


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes, row after row (uint8, sharing its memory)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


class OnlineFeatures:
    """An online plan read as stored features (module docstring). ``load(ref)`` gives a sequence's ``input_ids`` and
    ``loss_mask`` only (what the draft vocabulary, the bigram and the eval read); the scored tensors come through
    ``read_rows``, once ``bind`` has given a scorer. ``scored`` and ``scored_tokens`` count the shards (and their
    tokens) scored so far, a shard scored again in a later epoch again; ``score_s`` is the time scoring took, the
    held-out rows' included."""

    def __init__(self, root: Path, recipe: Recipe) -> None:
        self.root = Path(root)
        self.manifest = m = load_features_manifest(self.root)
        if not m.complete or not m.online:
            raise UserError(f"{self.root}: not a complete online plan; rerun `mtp-train precompute` with "
                            "precompute.mode=online")
        if target_fingerprint(recipe.target.path) != m.fingerprint["target"]:
            raise UserError(f"{self.root}: features were planned for a different target than {recipe.target.path}")
        indexes = load_indexes(self.root, m)
        entries = [e for shards in by_rank(m).values() for e in shards]
        self.sequences: SequenceTable = sequence_table([e.file for e in entries], list(indexes.values()))
        heldout = np.isin(self.sequences.row_id, np.asarray(m.heldout_row_ids, np.int64))
        self.train: SequenceTable = self.sequences[np.flatnonzero(~heldout)]
        self.heldout: SequenceTable = self.sequences[np.flatnonzero(heldout)]
        self._heldout_ids = set(self.heldout.row_id.tolist())
        self.rows = PlannedRows(recipe, m, self.root)
        self.shard_bytes = {e.file: 0 for e in m.shards}  # nothing is read from disk, so nothing ahead
        self.cache_bytes = int(recipe.precompute.online_cache_gb * 2**30)
        self._layout = row_layouts(m)
        # the table lists the shards' sequences shard after shard: each shard's are one run of it
        counts = np.bincount(self.sequences.shard, minlength=len(self.sequences.names))
        ends = np.cumsum(counts)
        self._members = {name: (int(end - n), int(end)) for name, n, end in zip(self.sequences.names, counts, ends)}
        self._held: OrderedDict[str, Arrays] = OrderedDict()  # scored shards, oldest first
        self._tokens: OrderedDict[str, Arrays] = OrderedDict()  # a few shards' token ids and masks
        self._encoder = ShardEncoder(self._encode_shard)  # shards' rows, encoded ahead of their scoring
        self._heldout: tuple[Arrays, dict[int, int]] | None = None  # held-out rows, and each row's first token
        self._score: Scorer | None = None
        self.scored = self.scored_tokens = 0
        self.score_s = 0.0

    # -- what FeatureReader offers -------------------------------------------------------------------------------

    def row_layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return self._layout[name]

    def read_ahead(self, shards: Iterable[str]) -> None:
        """Nothing to read ahead: ``ensure`` scores the shards before their rows are read."""

    def reset_read_ahead(self) -> None:
        """Nothing was read ahead."""

    def load(self, ref: SequenceRef) -> dict[str, torch.Tensor]:
        """``input_ids [n]`` int32 and ``loss_mask [n]`` uint8 of one sequence (a held-out one encoded alone: the
        eval reads them, spread over the shards)."""
        if ref.shard not in self._held and ref.row_id in self._heldout_ids:
            row = self.rows.encode_checked([ref.row_id], ref.stop - ref.start, f"held-out row {ref.row_id}")
            return {"input_ids": torch.from_numpy(row.ids), "loss_mask": torch.from_numpy(row.mask)}
        arrays, base = self._token_source(ref)
        first = base + ref.start
        return {"input_ids": torch.from_numpy(arrays["input_ids"][4 * first : 4 * (first + ref.stop - ref.start)]
                                              .view(np.int32)),
                "loss_mask": torch.from_numpy(arrays["loss_mask"][first : first + ref.stop - ref.start])}

    def read_rows(self, refs: list[SequenceRef] | SequenceTable, lengths: list[int], out: dict[str, np.ndarray]
                  ) -> None:
        """``FeatureReader.read_rows`` from the held shards: each ``out[name]`` gets the first ``lengths[i]`` rows
        of every ref, back to back. A shard not held is scored first (``ensure``)."""
        row_bytes = {name: self._layout[name][0].itemsize * int(np.prod(self._layout[name][1])) for name in out}
        views = {name: memoryview(buf).cast("B") for name, buf in out.items()}
        shards = dict.fromkeys(r.shard for r in refs if not self._is_heldout(r))
        if any(s not in self._held for s in shards):
            self.ensure(shards)
        pos = 0
        for ref, n in zip(refs, lengths):
            arrays, base = self._scored_source(ref)
            first = base + ref.start
            for name, rb in row_bytes.items():
                views[name][pos * rb : (pos + n) * rb] = arrays[name][first * rb : (first + n) * rb]
            pos += n

    # -- scoring -------------------------------------------------------------------------------------------------

    def bind(self, score: Scorer) -> None:
        """Score with ``score`` from now on; the held-out sequences are scored now, in one call (every process of
        a tensor-parallel group binds at the same point, so their forwards line up)."""
        self._score = score
        refs = self.heldout
        if not len(refs):
            self._heldout = ({}, {})
            return
        arrays = self._scored(self.rows.encode_checked(refs.row_id.tolist(), refs.lengths, "the held-out rows"))
        starts = np.concatenate([[0], np.cumsum(refs.lengths)[:-1]])
        self._heldout = arrays, {int(r): int(s) for r, s in zip(refs.row_id, starts)}

    def ensure(self, needed: Iterable[str]) -> None:
        """Hold the shards ``needed`` (scored in that order where they are not held yet), after dropping the oldest
        other shards until what is held fits ``cache_bytes``. Every process of a tensor-parallel group calls it with
        the same shards at the same point, so that they score together."""
        want = list(dict.fromkeys(needed))
        keep = set(want)
        held = self.held_bytes
        for name in list(self._held):
            if held <= self.cache_bytes:
                break
            if name not in keep:
                held -= sum(a.nbytes for a in self._held.pop(name).values())
        for name in want:
            if name not in self._held:
                self._held[name] = self._score_shard(name)
            self._held.move_to_end(name)

    def prepare(self, names: Iterable[str]) -> None:
        """Encode the rows of the shards ``names`` on the encoding thread, ahead of the ``ensure`` that scores them,
        so that the training step's path only scores (``ShardEncoder.prepare``: what an earlier call asked for and
        this one does not name is dropped)."""
        self._encoder.prepare(n for n in names if n not in self._held)

    def close(self) -> None:
        """Stop the encoding thread."""
        self._encoder.close()

    @property
    def held_bytes(self) -> int:
        """Bytes of the scored shards held now (the held-out rows not counted)."""
        return sum(a.nbytes for arrays in self._held.values() for a in arrays.values())

    def pages_needed(self, batch_tokens: int, page_size: int) -> int:
        """KV pages of the largest forward ``score`` makes here: the shards' sequences (and the held-out ones), cut
        into ``batch_tokens`` batches in order as ``Engine.score`` cuts them."""
        lengths = self.sequences.lengths
        groups = [lengths[a:b] for a, b in self._members.values()] + [self.heldout.lengths]
        most = 1
        for lengths in groups:
            pages = -(-lengths // page_size)
            for batch in group_by_tokens(lengths.tolist(), batch_tokens):
                most = max(most, int(pages[batch].sum()))
        return most

    def _score_shard(self, name: str) -> Arrays:
        a, b = self._members[name]
        arrays = self._scored(self._encoder.take(name))
        self.scored += 1
        self.scored_tokens += int(self.sequences.lengths[a:b].sum())
        return arrays

    def _encode_shard(self, name: str) -> EncodedRows:
        """The token ids and masks of shard ``name``'s rows (on the encoding thread when prepared)."""
        a, b = self._members[name]
        return self.rows.encode_checked(self.sequences.row_id[a:b].tolist(), self.sequences.lengths[a:b], name)

    def _scored(self, rows: EncodedRows) -> Arrays:
        """The tensors a shard of ``rows`` holds (``cu_seqlens`` left out), as bytes: ``score`` stores each batch's
        hidden states (bf16, or FP8) where it computed them."""
        if self._score is None:
            raise RuntimeError("OnlineFeatures: no scorer bound; call bind() first")
        began = time.perf_counter()
        tensors = scored_tensors(self._score(rows.sequences()), self.manifest.topk, self.manifest.hidden_dtype)
        self.score_s += time.perf_counter() - began
        arrays = rows.arrays()
        for name, (dtype, row) in self._layout.items():
            if name not in arrays:
                t = tensors[name]
                assert t.dtype == dtype and tuple(t.shape[1:]) == row, (name, t.dtype, tuple(t.shape))
                arrays[name] = _as_bytes(t)
        return arrays

    def _scored_source(self, ref: SequenceRef) -> tuple[Arrays, int]:
        """Where ``ref``'s scored rows are (the held-out rows, or its held shard), and the offset that turns
        ``ref.start`` into a row there."""
        if self._is_heldout(ref):
            return self._heldout[0], self._heldout[1][ref.row_id] - ref.start
        return self._held[ref.shard], 0

    def _is_heldout(self, ref: SequenceRef) -> bool:
        return self._heldout is not None and ref.row_id in self._heldout[1]

    def _token_source(self, ref: SequenceRef) -> tuple[Arrays, int]:
        """Where ``ref``'s token ids and mask are: its scored shard when held, else its shard's encoding (kept for
        the last ``TOKEN_SHARDS`` shards asked for)."""
        if ref.shard in self._held:
            return self._held[ref.shard], 0
        if ref.shard not in self._tokens:
            self._tokens[ref.shard] = self._encoder.take(ref.shard, keep=True).arrays()
            while len(self._tokens) > TOKEN_SHARDS:
                self._tokens.popitem(last=False)
        return self._tokens[ref.shard], 0


Features = FeatureReader | OnlineFeatures  # what training and the eval read: stored features, or an online plan
