"""The per-sequence index of a features directory, kept apart from ``manifest.json`` so that the manifest stays small.

Each rank writes ``index.rank-RRRRR.safetensors`` beside its manifest, atomically, before each manifest update:

| tensor | shape | dtype | meaning |
|---|---|---|---|
| ``row_ids`` | [N] | int64 | the dataset row of each stored sequence, shard after shard in the manifest's order |
| ``seq_tokens`` | [N] | int32 | each sequence's tokens (a shard's ``cu_seqlens`` are their running sums) |
| ``shard_seqs`` | [S] | int64 | each shard's sequences |
| ``owned_rows`` | [R] | int64 | every row the rank owns (bad rows excluded), for ``verify``'s coverage check |

The manifest is the commit point: an index may list more shards than its manifest (a crash between the two
writes); only the manifest's shards count. Readers load the index as flat arrays (:class:`SequenceTable`), never
one Python object per sequence, and need not open a shard to learn where its sequences are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_numpy, save as save_numpy

from mtp_train.errors import UserError
from mtp_train.io import write_atomic

if TYPE_CHECKING:
    from mtp_train.features.manifest import Manifest, ShardEntry


def index_name(rank: int) -> str:
    return f"index.rank-{rank:05d}.safetensors"


@dataclass
class RankIndex:
    """One rank's index in memory: ``owned [R]`` int64, and per shard its row ids and tokens per sequence."""

    owned: np.ndarray
    shard_rows: list[np.ndarray]  # [n_s] int64 each
    shard_tokens: list[np.ndarray]  # [n_s] int32 each

    def add(self, row_ids: list[int], tokens: list[int]) -> None:
        self.shard_rows.append(np.asarray(row_ids, np.int64))
        self.shard_tokens.append(np.asarray(tokens, np.int32))

    def rows_of(self, shard: int) -> list[int]:
        return self.shard_rows[shard].tolist()

    def save(self, path: Path) -> None:
        tensors = {
            "row_ids": _cat(self.shard_rows, np.int64),
            "seq_tokens": _cat(self.shard_tokens, np.int32),
            "shard_seqs": np.asarray([len(r) for r in self.shard_rows], np.int64),
            "owned_rows": np.ascontiguousarray(self.owned, np.int64),
        }
        write_atomic(path, save_numpy(tensors))


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def load_index(path: Path, shard_seqs: list[int], shard_tokens: list[int]) -> RankIndex:
    """The index at ``path``, cut to the manifest's first ``len(shard_seqs)`` shards, which must hold
    ``shard_seqs[s]`` sequences of ``shard_tokens[s]`` tokens; anything else is a one-line error naming it."""
    try:
        t = load_numpy(path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path}: missing (the features' per-sequence index); rerun precompute") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable index ({str(e)[:120]}); rerun precompute with --overwrite") from None
    need = {"row_ids", "seq_tokens", "shard_seqs", "owned_rows"} - set(t)
    if need:
        raise UserError(f"{path}: not a features index (no {sorted(need)}); rerun precompute with --overwrite")
    seqs = t["shard_seqs"]
    n = len(shard_seqs)
    if len(seqs) < n or seqs[:n].tolist() != list(shard_seqs) or int(seqs.sum()) != len(t["row_ids"]):
        raise UserError(f"{path}: its shards do not match the manifest's; rerun precompute with --overwrite")
    bounds = np.concatenate([[0], np.cumsum(seqs[:n])])
    rows = [t["row_ids"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    tokens = [t["seq_tokens"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    if [int(x.sum()) for x in tokens] != list(shard_tokens):
        raise UserError(f"{path}: its sequences' tokens do not add up to the manifest's; rerun precompute with "
                        "--overwrite")
    return RankIndex(t["owned_rows"], rows, tokens)


def by_rank(manifest: Manifest) -> dict[int, list[ShardEntry]]:
    """The manifest's shards grouped by the rank that wrote them, ranks ascending, each in its written order."""
    groups: dict[int, list[ShardEntry]] = {r: [] for r in sorted(manifest.ranks)}
    for entry in manifest.shards:
        groups.setdefault(entry.rank, []).append(entry)
    return groups


def load_indexes(root: Path, manifest: Manifest) -> dict[int, RankIndex]:
    """Each rank's index (:func:`load_index`), checked against the manifest's shards of that rank."""
    return {rank: load_index(root / index_name(rank), [s.num_seqs for s in shards], [s.num_tokens for s in shards])
            for rank, shards in by_rank(manifest).items()}


@dataclass(frozen=True)
class SequenceRef:
    """Where one stored sequence lives: shard file and token range ``[start, stop)``."""

    row_id: int
    shard: str
    start: int
    stop: int


class SequenceTable:
    """Stored sequences as flat arrays: ``shard [N]`` int32 (into ``names``), ``start``/``stop [N]`` int64 (token
    range within the shard), ``row_id [N]`` int64. Indexing by an int gives a :class:`SequenceRef`; by a slice or
    an index array, another table."""

    def __init__(self, names: list[str], shard: np.ndarray, start: np.ndarray, stop: np.ndarray,
                 row_id: np.ndarray) -> None:
        self.names, self.shard, self.start, self.stop, self.row_id = names, shard, start, stop, row_id

    def __len__(self) -> int:
        return len(self.shard)

    def __getitem__(self, i):
        if isinstance(i, (slice, np.ndarray, list)):
            return SequenceTable(self.names, self.shard[i], self.start[i], self.stop[i], self.row_id[i])
        return SequenceRef(int(self.row_id[i]), self.names[self.shard[i]], int(self.start[i]), int(self.stop[i]))

    def __iter__(self) -> Iterator[SequenceRef]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        """``[N]`` int64 tokens of each sequence."""
        return self.stop - self.start

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def sequence_table(names: list[str], indexes: list[RankIndex]) -> SequenceTable:
    """Every sequence of the shards ``names`` (the manifest's order), whose indexes are ``indexes`` in rank order."""
    tokens = [t for index in indexes for t in index.shard_tokens]
    counts = np.asarray([len(t) for t in tokens], np.int64)
    lengths = _cat(tokens, np.int64)
    shard = np.repeat(np.arange(len(tokens), dtype=np.int32), counts)
    ends = np.cumsum(lengths)
    first = np.concatenate([[0], np.cumsum(counts)])[:-1]  # each shard's first sequence
    shard_base = (ends - lengths)[np.minimum(first, max(len(lengths) - 1, 0))] if len(lengths) else first
    start = ends - lengths - np.repeat(shard_base, counts)
    row_id = _cat([r for index in indexes for r in index.shard_rows], np.int64)
    return SequenceTable(names, shard, start, start + lengths, row_id)
