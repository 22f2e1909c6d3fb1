"""The disk the features take, and the check that their filesystem holds it, made before anything is written."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from mtp_train.errors import UserError


def size(n: float) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def bytes_per_token(layers: int, hidden_size: int, topk: int) -> int:
    """One token's bytes in a shard: the bf16 hidden states of ``layers`` stored layers, the int32 token id, the
    uint8 loss mask and the fp32 log-sum-exp; with a top-K, K bf16 log-probs, K int32 ids and the fp32 tail mass.
    (Each sequence adds 8 bytes of ``cu_seqlens``, and each shard its header: not counted.)"""
    return layers * hidden_size * 2 + 4 + 1 + 4 + (6 * topk + 4 if topk else 0)


def free_bytes(path: Path) -> tuple[Path, int]:
    """The nearest existing folder at or above ``path``, and the bytes free to this user on its filesystem."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, shutil.disk_usage(where).free


@dataclass(frozen=True)
class DiskPlan:
    """The features' bytes (``tokens`` x ``per_token``), split over ``tasks`` array tasks, against the free space
    of the filesystem that holds ``features_dir``."""

    features_dir: Path
    tokens: int
    per_token: int
    tasks: int
    how: str  # how ``tokens`` was found, for the line

    @property
    def total(self) -> int:
        return self.tokens * self.per_token

    def lines(self) -> list[str]:
        where, free = free_bytes(self.features_dir)
        verdict = "fits" if self.total <= free else "DOES NOT FIT"
        per_task = f", {size(self.total / self.tasks)} per array task of {self.tasks}" if self.tasks > 1 else ""
        return ["disk for the features:",
                f"  {self.tokens:,} tokens ({self.how}) x {self.per_token:,} B = {size(self.total)}{per_task}; "
                f"{size(free)} free on the filesystem of {where}: {verdict}"]

    def check(self) -> None:
        """A one-line :class:`UserError` when the features' filesystem lacks the space they need."""
        require_space(self.features_dir, self.total, "the features")


def require_space(directory: Path, needed: int, what: str) -> None:
    where, free = free_bytes(directory)
    if needed > free:
        raise UserError(f"{directory}: {what} need {size(needed)}, but the filesystem of {where} has {size(free)} "
                        "free; free some space, or set precompute.features_dir to a larger filesystem")
