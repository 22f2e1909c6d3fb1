"""The disk the features take, and the check that their filesystem holds it, made before anything is written."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from mtp_train.errors import UserError


def size(n: float) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def bytes_per_token(layers: int, hidden_size: int, topk: int, hidden_dtype: str = "bf16") -> int:
    """One token's bytes in a shard: the hidden states of ``layers`` stored layers (bf16; or ``fp8``: one byte each
    and a float32 scale per layer), the int32 token id, the uint8 loss mask and the fp32 log-sum-exp; with a
    top-K, K bf16 log-probs, K int32 ids and the fp32 tail mass. (Each sequence adds 8 bytes of ``cu_seqlens``,
    and each shard its header: not counted.) ``hidden_dtype`` is the recipe's name or the manifest's."""
    hidden = layers * (hidden_size + 4) if hidden_dtype in ("fp8", "float8_e4m3fn") else layers * hidden_size * 2
    return hidden + 4 + 1 + 4 + (6 * topk + 4 if topk else 0)


def free_bytes(path: Path) -> tuple[Path, int]:
    """The nearest existing folder at or above ``path``, and the bytes free to this user on its filesystem."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, shutil.disk_usage(where).free


@dataclass(frozen=True)
class DiskPlan:
    """The features' bytes (``tokens`` x bytes per token) split over ``tasks`` array tasks, for each way to store the
    hidden states (``per_token``: bytes per token by ``precompute.hidden_dtype``), against the free space of the
    filesystem that holds ``features_dir``. ``stored`` is the recipe's choice, or ``online`` (nothing is written)."""

    features_dir: Path
    tokens: int
    per_token: dict[str, int]
    stored: str  # a key of per_token, or "online"
    tasks: int
    how: str  # how ``tokens`` was found, for the line
    longest: tuple[int, int] = (0, 0)  # the longest sampled row's tokens, and data.max_length (what one sample holds)

    @property
    def total(self) -> int:
        return 0 if self.stored == "online" else self.tokens * self.per_token[self.stored]

    def lines(self) -> list[str]:
        where, free = free_bytes(self.features_dir)
        verdict = "fits" if self.total <= free else "DOES NOT FIT"
        per_task = f", {size(self.total / self.tasks)} per array task of {self.tasks}" if self.tasks > 1 else ""
        sizes = "; ".join(f"{dtype} {n:,} B/token = {size(self.tokens * n)}" for dtype, n in self.per_token.items())
        chosen = ("precompute.mode online: 0 B stored (training scores the shards)" if self.stored == "online"
                  else f"precompute.hidden_dtype {self.stored}: {size(self.total)}{per_task}")
        lines = ["disk for the features:", f"  {self.tokens:,} tokens ({self.how}): {sizes}"]
        if self.longest[1]:
            row, most = self.longest
            lines.append(f"  one sample: the longest sampled row, {row:,} tokens, {self._sample(row)}; at "
                         f"data.max_length, {most:,} tokens, {self._sample(most)}")
        return lines + [f"  {chosen}; {size(free)} free on the filesystem of {where}: {verdict}"]

    def _sample(self, tokens: int) -> str:
        return ", ".join(f"{dtype} {size(tokens * n)}" for dtype, n in self.per_token.items())

    def check(self) -> None:
        """A one-line :class:`UserError` when the features' filesystem lacks the space they need."""
        require_space(self.features_dir, self.total, "the features")


def require_space(directory: Path, needed: int, what: str) -> None:
    where, free = free_bytes(directory)
    if needed > free:
        raise UserError(f"{directory}: {what} need {size(needed)}, but the filesystem of {where} has {size(free)} "
                        "free; free some space, or set precompute.features_dir to a larger filesystem")
