"""Runtime throughput against transformers, measured side by side in one run (CPU, fp32).

    .venv/bin/python bench/runtime_bench.py [--smollm2] [--only-smollm2]

1. Packed ``score()`` tokens/s vs a padded transformers forward over the same sequences,
   on the tiny target and on a random Llama (hidden 512, 8 layers).
2. Greedy decode tokens/s vs ``transformers.generate`` at batch 1 and 8 on the tiny target.
3. With ``--smollm2``: both again on the real SmolLM2-135M-Instruct (``make smollm2`` fetches it).

Each figure is the best of ``--repeats`` runs, interleaved with the other side's, so a noisy
neighbour on a shared machine hurts both alike; only the ratios are meant to be compared.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny" / "target"
SMOLLM2 = REPO / ".cache" / "smollm2-135m-instruct"


def paired_best(repeats: int, ours: Callable[[], object], reference: Callable[[], object]) -> tuple[float, float]:
    """Best wall time of each side, runs interleaved so that drift on a shared machine hits both alike."""
    ours()
    reference()  # warm-up
    t_ours, t_ref = [], []
    for _ in range(repeats):
        for fn, times in ((ours, t_ours), (reference, t_ref)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(t_ours), min(t_ref)


def random_llama(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).save_pretrained(root)
    return root


def lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def bench_score(root: Path, name: str, repeats: int) -> tuple[str, float, float]:
    from transformers import AutoModelForCausalLM

    from mtp_train.runtime.engine import Engine

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in lengths(16, 64, 512, seed=2)]
    tokens = sum(map(len, seqs))
    engine = Engine.from_pretrained(root, max_batch_tokens=4096)
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()

    def ours() -> None:
        engine.score(seqs, layers=[-1], topk=32)

    def reference() -> None:
        # The same token budget per forward as the runtime: batches of sequences padded to the longest.
        with torch.inference_mode():
            i = 0
            while i < len(seqs):
                j, total = i, 0
                while j < len(seqs) and (j == i or total + len(seqs[j]) <= 4096):
                    total += len(seqs[j])
                    j += 1
                batch = seqs[i:j]
                width = max(map(len, batch))
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for b, s in enumerate(batch):
                    ids[b, : len(s)] = torch.tensor(s)
                    mask[b, : len(s)] = 1
                hf(input_ids=ids, attention_mask=mask)
                i = j

    t_ours, t_ref = paired_best(repeats, ours, reference)
    return name, tokens / t_ours, tokens / t_ref


def bench_decode(root: Path, name: str, batch: int, repeats: int, new_tokens: int = 64) -> tuple[str, float, float]:
    from transformers import AutoModelForCausalLM

    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in lengths(batch, 16, 128, seed=4)]
    engine = Engine.from_pretrained(root, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    width = max(map(len, prompts))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding, as generate expects
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1

    def ours() -> None:
        engine.generate(prompts, params)

    def reference() -> None:
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=2)

    t_ours, t_ref = paired_best(repeats, ours, reference)
    generated = batch * new_tokens
    return f"greedy decode, {name}, batch {batch}", generated / t_ours, generated / t_ref


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smollm2", action="store_true", help="also measure the real SmolLM2-135M-Instruct")
    p.add_argument("--only-smollm2", action="store_true", help="measure SmolLM2-135M-Instruct only")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    if not args.only_smollm2:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(bench_score(TINY, "score(), tiny target (1.8M)", args.repeats))
            rows.append(bench_score(random_llama(Path(tmp)), "score(), random Llama h512 x 8 layers", args.repeats))
        rows.append(bench_decode(TINY, "tiny target", 1, args.repeats))
        rows.append(bench_decode(TINY, "tiny target", 8, args.repeats))
    if args.smollm2 or args.only_smollm2:
        if not (SMOLLM2 / ".complete").is_file():
            raise SystemExit(f"{SMOLLM2} is absent: run `make smollm2` first")
        rows.append(bench_score(SMOLLM2, "score(), SmolLM2-135M-Instruct (30 layers)", args.repeats))
        rows.append(bench_decode(SMOLLM2, "SmolLM2-135M-Instruct", 1, args.repeats, new_tokens=32))
        rows.append(bench_decode(SMOLLM2, "SmolLM2-135M-Instruct", 8, args.repeats, new_tokens=32))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU\n")
    print("| what | mtp-train tok/s | transformers tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for name, ours, ref in rows:
        print(f"| {name} | {ours:,.0f} | {ref:,.0f} | {ours / ref:.2f}x |")


if __name__ == "__main__":
    main()
