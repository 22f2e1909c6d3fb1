"""Run under ``torchrun --nproc_per_node 2``: each rank measures a different KV budget (as ranks whose free memory
differs would), then decodes under page pressure; the leader saves its page count, every rank's, and the tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mtp_train.models.checkpoint import load_transformer
from mtp_train.models.tp import init_tensor_parallel
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.kv_cache import KVPool
from mtp_train.runtime.sampling import SamplingParams


def main(target: str, prompts_file: str, out_file: str, pages: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(2, torch.device("cpu"))
    model = load_transformer(Path(target), tp=tp)
    per_page = 4 * KVPool.bytes_per_token(model.cfg, torch.float32, tp.size)
    mine = int(pages.split(",")[tp.rank])  # this rank's measured budget, in pages
    engine = Engine(model, page_size=4, kv_bytes=mine * per_page, max_seqs=8)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.size)]
    dist.all_gather(counts, torch.tensor([engine.allocator.num_pages]))
    prompts = torch.load(prompts_file, weights_only=True)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=24, stop_token_ids=()))
    if tp.is_leader:
        torch.save({"pages": [int(c) for c in counts], "tokens": [r.tokens for r in out]}, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
