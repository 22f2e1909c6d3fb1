"""One prepared CUDA check: flashinfer backend parity against the torch backend, and both backends' throughput.

    python bench/gpu_check.py            # on a machine with a CUDA GPU and `pip install -e '.[gpu]'`

Prints a Markdown table for bench/RESULTS.md and exits non-zero if parity fails.
On a machine without CUDA it says so and exits 0 without measuring anything.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch


def build_model(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root)
    return root


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was measured. Run this on a GPU machine.")
        return 0
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (17, 300, 1000, 64, 513, 2000, 5, 128)]
    params = SamplingParams(max_new_tokens=128, stop_token_ids=())
    with tempfile.TemporaryDirectory() as tmp:
        root = build_model(Path(tmp))
        engines = {
            name: Engine.from_pretrained(root, dtype=torch.bfloat16, device="cuda", backend=name, page_size=16,
                                         max_batch_tokens=16384)
            for name in ("torch", "flashinfer")
        }
        scores = {n: e.score(seqs, layers=[-1], topk=8) for n, e in engines.items()}
        gens = {n: [r.tokens for r in e.generate(seqs, params)] for n, e in engines.items()}
        rows = []
        for n, e in engines.items():
            t_score = min(timed(lambda: e.score(seqs, layers=[-1], topk=32)) for _ in range(3))
            t_gen = min(timed(lambda: e.generate(seqs, params)) for _ in range(2))
            rows.append((n, sum(map(len, seqs)) / t_score, len(seqs) * 128 / t_gen))
    a, b = scores["torch"], scores["flashinfer"]
    lp_diff = (a.topk_logprobs[:, 0] - b.topk_logprobs[:, 0]).abs().max().item()
    top1 = (a.topk_ids[:, 0] == b.topk_ids[:, 0]).float().mean().item()
    hidden_diff = (a.hidden.float() - b.hidden.float()).abs().max().item()
    same_tokens = sum(x == y for x, y in zip(gens["torch"], gens["flashinfer"]))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    print(f"parity: max |top-1 logprob diff| {lp_diff:.4f}, top-1 agreement {top1:.4f}, "
          f"max |hidden diff| {hidden_diff:.4f}, identical greedy outputs {same_tokens}/{len(seqs)}")
    print("\n| backend | score() tok/s | greedy decode tok/s (batch 8) |\n|---|---:|---:|")
    for n, s, d in rows:
        print(f"| {n} | {s:,.0f} | {d:,.0f} |")
    ok = top1 >= 0.99 and lp_diff <= 0.1
    print("\nPARITY", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
