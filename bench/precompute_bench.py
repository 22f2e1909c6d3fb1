"""Precompute throughput against ``score()`` alone, and the storage cost per token.

    .venv/bin/python bench/precompute_bench.py [--rows 4000]

1. End-to-end ``precompute`` (data loading, tokenization, fingerprints, forward, shard writes,
   manifest) over the first ``--rows`` SGD train dialogues, against ``Engine.score()`` alone over
   the same shards, measured in the same run. Goal: ratio >= 0.85, i.e. writing hides behind compute.
2. Bytes per token for K = 0, 32 and 64 at the tiny target's hidden size (measured on disk for the
   recipe's K, and by formula), and the same formula for Llama-3-70B beside storing full logits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402


def bytes_per_token(hidden: int, layers: int, k: int) -> int:
    """hidden bf16 + top-K (bf16 log-prob + int32 id) + input id int32 + mask uint8 + logsumexp fp32."""
    return layers * hidden * 2 + k * (2 + 4) + 4 + 1 + 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4000)
    args = p.parse_args()
    print(machine_line(), flush=True)

    # Module imports (datasets, transformers' tokenizer classes) cost a few seconds once per process,
    # not per token; pay them before the clock starts.
    import datasets  # noqa: F401
    from transformers import AutoTokenizer, LlamaConfig  # noqa: F401

    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.engine import Engine
    from mtp_train.features.reader import FeatureReader
    from mtp_train.precompute.run import run_precompute

    with tempfile.TemporaryDirectory() as tmp:
        recipe_path = Path(tmp) / "bench.yaml"
        data = yaml.safe_load((REPO / "recipes/tiny.yaml").read_text())
        data["output_dir"] = str(Path(tmp) / "run")
        data["target"]["path"] = str(REPO / "recipes/tiny/target")
        data["data"]["train"] = str(REPO / "data/sgd/sgd_train_sharegpt.jsonl.gz")
        data["data"]["max_rows"] = args.rows
        recipe_path.write_text(yaml.safe_dump(data))
        recipe = load_recipe(recipe_path)

        start = time.perf_counter()
        manifest = run_precompute(recipe)
        t_end_to_end = time.perf_counter() - start
        tokens = manifest.total_tokens

        reader = FeatureReader(recipe.features_dir)
        engine = Engine.from_pretrained(recipe.target.path, max_batch_tokens=recipe.precompute.batch_tokens)
        shards = {}
        for ref in reader.sequences:
            shards.setdefault(ref.shard, []).append(reader.load(ref)["input_ids"].tolist())
        start = time.perf_counter()
        for seqs in shards.values():
            engine.score(seqs, layers=recipe.precompute.layers, topk=recipe.precompute.topk)
        t_score = time.perf_counter() - start
        measured_bpt = manifest.total_bytes / tokens

    print(f"rows {args.rows}, {tokens:,} tokens, {len(manifest.shards)} shards, top-{recipe.precompute.topk}\n")
    print("| what | tok/s |\n|---|---:|")
    print(f"| precompute end to end | {tokens / t_end_to_end:,.0f} |")
    print(f"| score() alone, same shards | {tokens / t_score:,.0f} |")
    print(f"| ratio | {t_score / t_end_to_end:.2f} |\n")
    print("| model | K | bytes/token | vs full logits |\n|---|---:|---:|---:|")
    for k in (0, 32, 64):
        b = bytes_per_token(128, 1, k)
        note = f" (measured on disk: {measured_bpt:.1f})" if k == recipe.precompute.topk else ""
        print(f"| tiny target, H=128, vocab 4,096 | {k} | {b}{note} | {b / (4096 * 2 + b):.1%} of {4096 * 2 + b:,} |")
    for k in (0, 32, 64):
        b = bytes_per_token(8192, 1, k)
        full = 128256 * 2 + b
        print(f"| Llama-3-70B, H=8192, vocab 128,256 | {k} | {b:,} | {b / full:.1%} of {full:,} |")


if __name__ == "__main__":
    main()
