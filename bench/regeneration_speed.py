"""Regeneration throughput on SmolLM2: greedy answers to Dolly prompts through the runtime's continuous batching.

    .venv/bin/python bench/regeneration_speed.py [--width 256] [--prompts 256] [--new-tokens 64]

Prints generated tokens/s and a hash of every output token, so runs of two versions of the runtime (or two
widths) can be set side by side and shown to produce the same tokens. Needs ``make smollm2``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtp_train.runtime.engine import Engine  # noqa: E402
from mtp_train.runtime.sampling import SamplingParams  # noqa: E402
from mtp_train.data.dataset import load_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256, help="sequences decoded at once (max_seqs)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    root = REPO / ".cache" / "smollm2-135m-instruct"
    if not (root / "config.json").is_file():
        sys.exit(f"{root}: not found; run `make smollm2` first")
    tokenizer = AutoTokenizer.from_pretrained(root)
    rows = load_rows([REPO / "data/general/prompts.jsonl.gz"], "openai", False, args.prompts).rows
    prompts = [tokenizer.apply_chat_template(r.content[:1], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for r in rows]
    engine = Engine.from_pretrained(root, max_batch_tokens=4096, max_seqs=args.width)
    start = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(0.0, 0, 1.0, args.new_tokens))
    elapsed = time.perf_counter() - start
    generated = sum(len(r.tokens) for r in results)
    digest = hashlib.md5(str([r.tokens for r in results]).encode()).hexdigest()
    print(f"width {args.width}, {len(prompts)} prompts ({sum(map(len, prompts)):,} prompt tokens), {generated:,} "
          f"tokens generated in {elapsed:.1f}s: {generated / elapsed:.1f} tok/s; outputs md5 {digest}")


if __name__ == "__main__":
    main()
