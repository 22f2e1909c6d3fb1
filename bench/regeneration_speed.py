"""Regeneration throughput on SmolLM2: greedy answers to Dolly prompts through the runtime's continuous batching.

    .venv/bin/python bench/regeneration_speed.py [--width 256] [--prompts 256] [--new-tokens 64]

Prints generated tokens/s and a hash of every output token, so runs of two versions of the runtime (or two
widths) can be set side by side and shown to produce the same tokens. Needs ``make smollm2``.

Then, in the same run, the bound this CPU's matrix multiplies put on it: every weight matmul of the model (q, k, v,
o, gate, up, down per layer, and the lm_head) timed with torch's ``linear`` at ``width`` rows (a decode step) and
at 4,096 rows (a prefill), per token; the bound is the generated tokens over the time those matmuls alone take for
all the run's prompt and generated tokens. Attention, norms, sampling and scheduling are what the runtime adds. The
matmuls are timed before and after the run and the faster of the two sets the bound: a shared machine's speed drifts
by 10% or more within minutes, and the faster timing gives the lower ratio.
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
from bench.machine import machine_line  # noqa: E402

from mtp_train.runtime.engine import CPU_KV_BYTES, Engine  # noqa: E402
from mtp_train.runtime.sampling import SamplingParams  # noqa: E402
from mtp_train.data.dataset import load_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256, help="sequences decoded at once (max_seqs)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gb", type=float, default=CPU_KV_BYTES / 2**30,
                        help="the KV cache in GiB (target.kv_cache_gb; the runtime's CPU default when unset)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    root = REPO / ".cache" / "smollm2-135m-instruct"
    if not (root / "config.json").is_file():
        sys.exit(f"{root}: not found; run `make smollm2` first")
    tokenizer = AutoTokenizer.from_pretrained(root)
    rows = load_rows([REPO / "data/general/prompts.jsonl.gz"], "openai", False, args.prompts).rows
    prompts = [tokenizer.apply_chat_template(r.content[:1], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for r in rows]
    engine = Engine.from_pretrained(root, max_batch_tokens=4096, max_seqs=args.width, kv_bytes=int(args.kv_gb * 2**30))
    before = matmul_seconds(engine.cfg, args.width), matmul_seconds(engine.cfg, 4096)
    start = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(0.0, 0, 1.0, args.new_tokens))
    elapsed = time.perf_counter() - start
    generated = sum(len(r.tokens) for r in results)
    digest = hashlib.md5(str([r.tokens for r in results]).encode()).hexdigest()
    slots = engine.allocator.num_pages * engine.allocator.page_size
    print(f"width {args.width}, KV cache {args.kv_gb:g} GiB ({slots:,} token slots), {len(prompts)} prompts "
          f"({sum(map(len, prompts)):,} prompt tokens), {generated:,} tokens generated in {elapsed:.1f}s: "
          f"{generated / elapsed:.1f} tok/s; outputs md5 {digest}")
    after = matmul_seconds(engine.cfg, args.width), matmul_seconds(engine.cfg, 4096)
    for when, (decode, prefill) in (("before", before), ("after", after)):
        print(f"matmuls alone {when} the run: {1 / decode:,.0f} tok/s at {args.width} rows, {1 / prefill:,.0f} tok/s "
              "at 4,096 rows")
    decode, prefill = min(before[0], after[0]), min(before[1], after[1])
    bound = generated / (sum(map(len, prompts)) * prefill + generated * decode)
    print(f"this run's bound {bound:.1f} tok/s (the faster of the two); "
          f"measured / bound {generated / elapsed / bound:.2f}")


def matmul_seconds(cfg, rows: int, repeats: int = 3) -> float:
    """Seconds per token of every weight matmul of the model at ``rows`` rows (best of ``repeats``)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (cfg.intermediate_size, h), (cfg.intermediate_size, h),
              (h, cfg.intermediate_size)]
    total = 0.0
    for out_f, in_f in shapes:
        x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
        total += cfg.num_layers * _best(lambda: torch.nn.functional.linear(x, w), repeats)
    x, w = torch.randn(rows, h), torch.randn(cfg.vocab_size, h)
    return (total + _best(lambda: torch.nn.functional.linear(x, w), repeats)) / rows


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    main()
