"""Host memory of the 8xH100 train job: where SLURM caps a job's memory its page cache counts against the cap, so the
shard files the trainer's loader asks to be read ahead are bounded (``mtp_train.train.data.READ_AHEAD_BYTES``) and
counted in the rendered ``--mem`` (``mtp_train.host_plan``)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import REPO, run_cli, stand_in_checkpoint
from mtp_train.features.index import SequenceTable
from mtp_train.train import data


class AskedAhead:
    """A features reader as the trainer's loader sees it, recording what each batch asks to be read ahead: shard
    files of ``shard_bytes`` each (``FeatureReader.shard_bytes``)."""

    def __init__(self, shard_bytes: dict[str, int]) -> None:
        self.shard_bytes = shard_bytes
        self.asked: list[int] = []  # bytes named by each call, all at once

    def read_ahead(self, shards) -> None:
        self.asked.append(sum(self.shard_bytes[s] for s in shards))


def _most_read_ahead(shard_tokens: int, per_token: int, shards: int, ranks: int, grad_accum: int) -> int:
    """The most bytes one training rank's loader asks the page cache for at once over an epoch, for features of
    ``shards`` full shards of ``shard_tokens`` tokens (sequences of 8,192), batches of 16,384 tokens."""
    seqs = shard_tokens // 8192
    names = [f"shard-00000-{s:05d}.safetensors" for s in range(shards)]
    start = np.tile(np.arange(seqs, dtype=np.int64) * 8192, shards)
    table = SequenceTable(names, np.repeat(np.arange(shards, dtype=np.int32), seqs), start, start + 8192,
                          np.arange(shards * seqs, dtype=np.int64))
    reader = AskedAhead({name: shard_tokens * per_token for name in names})
    plans = data.plan_rank(table, 16384, 0, 0, 0, ranks, grad_accum)
    for step in range(min(map(len, plans))):
        for plan in plans:
            data.read_ahead(reader, table[np.asarray(plan[step])])
    return max(reader.asked)


@pytest.mark.parametrize("shard_tokens", [1048576, 131072])
def test_training_read_ahead_fits_the_memory_the_70b_train_job_asks_for(tmp_path, shard_tokens):
    """Where SLURM caps a job's memory its page cache counts against the cap: the shard files each of a node's 8
    training ranks asks to be read ahead at once, beside each rank's process and frozen tensors, fit the train job's
    rendered ``--mem`` (the recipe's 1M-token shards, and 128k-token ones that are read ahead)."""
    from mtp_train.features.space import bytes_per_token
    from mtp_train.head_memory import frozen_bytes
    from mtp_train.host_plan import PROCESS_BYTES
    from mtp_train.models.config import ModelConfig

    target = tmp_path / "target"
    target.mkdir()
    stand_in_checkpoint(target, REPO / "recipes" / "configs" / "llama-3.3-70b.json")
    proc = run_cli("slurm", REPO / "recipes/llama3.3-70b.yaml", f"target.path={target}", f"output_dir={tmp_path}",
                   f"precompute.shard_tokens={shard_tokens}", "--nodes", "4", "--gpus-per-node", "8", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    train = proc.stdout.split("train.sbatch ----\n", 1)[1].split("# ---- ", 1)[0]
    mem = int(re.search(r"#SBATCH --mem=(\d+)G\n", train).group(1)) * 2**30
    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()), "config.json")
    per_token = bytes_per_token(1, cfg.hidden_size, 64)
    # 320 shards of 1M tokens: ultrachat's 200k rows with regenerated answers; 32 ranks x 2 lanes split the windows
    ahead = _most_read_ahead(shard_tokens, per_token, 320 * 1048576 // shard_tokens, 32, 2)
    assert shard_tokens == 1048576 or ahead > 0, "shards that fit the budget are read ahead"
    rest = 8 * (PROCESS_BYTES + frozen_bytes(cfg))
    assert 8 * ahead + rest <= mem, (ahead / 2**30, rest / 2**30, mem / 2**30)
