"""Run under ``torchrun --nproc_per_node N``: load the tiny target with TP=N, score and generate, save rank 0's results."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mtp_train.models.checkpoint import load_transformer
from mtp_train.models.tp import init_tensor_parallel
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.drafters import DraftModelDrafter
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.tree import TreeShape
from mtp_train.runtime.tree_decoder import TreeDecoder


def main(target: str, prompts_file: str, out_file: str, tp_size: int) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(tp_size, torch.device("cpu"))
    assert tp.size == tp_size, f"expected world size {tp_size}, got {tp.size}"
    prompts = torch.load(prompts_file, weights_only=True)
    engine = Engine.from_pretrained(target, tp=tp, page_size=16)
    scored = engine.score(prompts, layers=[-1], topk=16)
    generated = engine.generate(prompts, SamplingParams(max_new_tokens=16, stop_token_ids=()))
    # Speculative decoding under TP: the draft (the target itself, unsharded) runs on the leader only.
    drafter = DraftModelDrafter(engine, load_transformer(Path(target)))
    speculative = SpeculativeDecoder(engine, drafter, 3).generate(prompts, SamplingParams(max_new_tokens=16, stop_token_ids=()))
    tree = TreeDecoder(engine, drafter, TreeShape(2, 3, 5)).generate(prompts, SamplingParams(max_new_tokens=16,
                                                                                               stop_token_ids=()))
    if tp.is_leader:
        torch.save(
            {
                "world_size": tp.size,
                "heads_per_rank": engine.model.layers[0].attention.n_heads,
                "topk_logprobs": scored.topk_logprobs,
                "topk_ids": scored.topk_ids,
                "logsumexp": scored.logsumexp,
                "hidden": scored.hidden,
                "tokens": [r.tokens for r in generated],
                "speculative_tokens": [r.tokens for r in speculative],
                "accepted": [r.stats.accepted for r in speculative],
                "tree_tokens": [r.tokens for r in tree],
            },
            out_file,
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
