"""A worker's shards: its encoded rows cut, in order, into shards of about ``precompute.shard_tokens`` tokens; each
shard is one ``Engine.score()`` call and one safetensors file, recorded in the rank's manifest once it is on disk."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtp_train.errors import UserError
from mtp_train.io import crash_point, group_by_tokens
from mtp_train.progress import Progress
from mtp_train.data.dataset import Row
from mtp_train.features.index import RankIndex, index_name
from mtp_train.features.manifest import Manifest, ShardEntry, rank_manifest_name, save_manifest, shard_name
from mtp_train.features.tensors import hidden_storage, shard_tensors
from mtp_train.features.writer import ShardWriter
from mtp_train.precompute.readback import ShardReadBack

if TYPE_CHECKING:
    from mtp_train.runtime.engine import Engine

Encoded = tuple[list[int], list[int], bool]  # token ids, loss mask, truncated


@dataclass(frozen=True)
class ShardPlan:
    """``rows`` and their encodings, cut into ``shards`` (each a list of indices into ``rows``)."""

    rows: list[Row]
    encoded: list[Encoded]
    shards: list[list[int]]

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def total_tokens(self) -> int:
        return sum(len(ids) for ids, _, _ in self.encoded)

    def row_ids(self, index: int) -> list[int]:
        return [self.rows[i].row_id for i in self.shards[index]]

    def tokens(self, index: int) -> int:
        return sum(len(self.encoded[i][0]) for i in self.shards[index])

    def seq_tokens(self, index: int) -> list[int]:
        return [len(self.encoded[i][0]) for i in self.shards[index]]

    def sequences(self, index: int) -> list[tuple[list[int], list[int]]]:
        """Token ids and loss mask of each row of shard ``index``."""
        return [(self.encoded[i][0], self.encoded[i][1]) for i in self.shards[index]]


def plan_shards(rows: list[Row], encoded: list[Encoded], shard_tokens: int, manifest: Manifest, index: RankIndex,
                out: Path) -> ShardPlan:
    """Cut the rows into shards; the shards ``manifest`` already records (their rows in ``index``) must be the
    plan's first ones."""
    plan = ShardPlan(rows, encoded, group_by_tokens([len(ids) for ids, _, _ in encoded], shard_tokens))
    for s, entry in enumerate(manifest.shards):
        if s >= len(plan) or index.rows_of(s) != plan.row_ids(s):
            raise UserError(f"{out / entry.file}: holds rows that no longer match the plan; rerun with --overwrite")
    return plan


def save_rank(out: Path, rank: int, manifest: Manifest, index: RankIndex) -> None:
    """The rank's index, then its manifest (the commit point: an index ahead of it is cut back on reading)."""
    index.save(out / index_name(rank))
    save_manifest(out / rank_manifest_name(rank), manifest)


def write_shards(plan: ShardPlan, manifest: Manifest, index: RankIndex, engine: Engine, out: Path, rank: int,
                 write: bool) -> None:
    """Score every shard of ``plan`` that rank ``rank``'s ``manifest`` does not record yet; with ``write`` (under
    tensor parallelism, the leader only) write each one to ``out``, record it in the index and the manifest once
    on disk, and read it back from disk beside the next forwards (``ShardReadBack``; the shards an earlier run
    recorded too): a shard that does not read back as written stops the run, in one line."""
    readback = ShardReadBack(out, manifest, index, rank) if write else None

    def record(shard: int, path: Path, sha: str, size: int) -> None:
        ids = plan.row_ids(shard)
        index.add(ids, plan.seq_tokens(shard))
        manifest.shards.append(ShardEntry(file=path.name, rank=rank, num_seqs=len(ids), num_tokens=plan.tokens(shard),
                                          sha256=sha, bytes=size))
        save_rank(out, rank, manifest, index)
        readback.submit(len(manifest.shards) - 1)

    if readback is None:
        _score_shards(plan, manifest, engine, out, rank, None, None)
        return
    for s in range(len(manifest.shards)):
        readback.submit(s)
    try:
        _score_shards(plan, manifest, engine, out, rank, ShardWriter(record), readback)
    except BaseException:
        readback.close(check=False)
        raise
    readback.close()


def _score_shards(plan: ShardPlan, manifest: Manifest, engine: Engine, out: Path, rank: int,
                  writer: ShardWriter | None, readback: ShardReadBack | None) -> None:
    """The forwards of the shards ``manifest`` does not record yet, each handed to ``writer`` (when there is one)
    in the bytes it stores: ``score`` converts each batch's hidden states where they were computed."""
    done = len(manifest.shards)
    store = hidden_storage(manifest.hidden_dtype)
    stored = sum(plan.tokens(s) for s in range(done))  # tokens of the shards already written
    progress = Progress("precompute", plan.total_tokens, "tokens", initial=stored, enabled=writer is not None)
    try:
        for s in range(done, len(plan)):
            crash_point("forward", s)
            if readback is not None:
                readback.check()
            seqs = plan.sequences(s)
            progress.note = f"shard {s + 1}/{len(plan)}"
            scored = engine.score([ids for ids, _ in seqs], layers=manifest.layers, topk=manifest.topk,
                                  on_batch=lambda n: progress.update(n, tokens=n), keep=writer is not None,
                                  store_hidden=store)
            if writer is not None:
                meta = {"format_version": "1", "rank": str(rank), "row_ids": json.dumps(plan.row_ids(s))}
                writer.submit(s, out / shard_name(rank, s), shard_tensors(scored, seqs, manifest.topk,
                                                                          manifest.hidden_dtype), meta)
    finally:
        progress.close()
        if writer is not None:
            writer.close()


def record_plan(plan: ShardPlan, manifest: Manifest, index: RankIndex, out: Path, rank: int) -> None:
    """``precompute.mode: online``: record every shard of ``plan`` that ``manifest`` does not hold yet, as training
    will score it (its rows and tokens; no file, so 0 bytes and no sha256), and save the rank once."""
    for s in range(len(manifest.shards), len(plan)):
        ids = plan.row_ids(s)
        index.add(ids, plan.seq_tokens(s))
        manifest.shards.append(ShardEntry(file=shard_name(rank, s), rank=rank, num_seqs=len(ids),
                                          num_tokens=plan.tokens(s), sha256="", bytes=0))
    save_rank(out, rank, manifest, index)
