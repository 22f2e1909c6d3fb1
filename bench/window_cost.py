"""The draft's cost c by context length, with and without a draft window (``head.window``), on SmolLM2.

    make smollm2
    .venv/bin/python bench/window_cost.py [--window 512] [--kind eagle3]

One engine, one head of ``--kind`` (random weights: c is a cost, not an acceptance) built twice, with full attention
and with ``--window``; for each, ``mtp_train.eval.context_probe.context_costs`` at k = 3 on the ``long`` prompt set
(one prompt per length bucket, its median, about 900 to 7,800 tokens) and on the held-out-sized prompts below 512:
one draft forward over one plain decode step, both at batch 1 on that context, the two measured side by side in one
run, ``--repeats`` times each in turn. It prints the machine line, then a table: c per bucket for both heads with
the two times it divides, and each one's c at the longest bucket over its c at 512-1023 tokens (the goal for a
window: at most 1.2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402
from mtp_train.eval.context_probe import context_times  # noqa: E402
from mtp_train.eval.prompts import load_prompt_set, render_prompt  # noqa: E402
from mtp_train.heads import build_head, head_spec  # noqa: E402
from mtp_train.runtime.drafters import head_drafter  # noqa: E402
from mtp_train.runtime.engine import Engine  # noqa: E402
from mtp_train.threads import set_threads  # noqa: E402

TARGET = REPO / ".cache" / "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kind", default="eagle3", choices=("mtp", "eagle", "eagle3"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="probes per bucket, their times pooled")
    args = ap.parse_args(argv)
    if not (TARGET / "config.json").is_file():
        sys.exit(f"window_cost: {TARGET} not found; run `make smollm2` first")
    set_threads(args.threads)
    print(machine_line(args.threads), flush=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    prompts = load_prompt_set("long") + load_prompt_set("spec_bench", max_prompts=13)  # 1k-8k, and under 512
    ids = [render_prompt(tokenizer, p.messages) for p in prompts]
    engine = Engine.from_pretrained(TARGET)
    cfg = engine.cfg
    torch.manual_seed(0)
    aux = (2, cfg.num_layers // 2, cfg.num_layers - 3) if args.kind == "eagle3" else ()
    full = build_head(head_spec(args.kind, 1, cfg, "bench", aux_layers=aux, draft_vocab=4096)).eval()
    windowed = build_head(dataclasses.replace(full.spec, window=args.window))
    windowed.load_state_dict(full.state_dict())
    rows = {}
    for name, head in (("full attention", full), (f"window {args.window}", windowed)):
        drafter = head_drafter(engine, head.eval())
        context_times(engine, drafter, 3, ids[-1:])  # warm-up, untimed
        rows[name] = context_times(engine, drafter, 3, ids, args.repeats)
    buckets = sorted({b for r in rows.values() for b in r}, key=lambda b: int(b.split("-")[0].rstrip("+")))
    print(f"\n| {args.kind} head, k = 3, batch 1: c (draft forward ms / plain decode step ms) | "
          + " | ".join(buckets) + " | c at the longest / c at 512-1023 |")
    print("|---|" + "---:|" * (len(buckets) + 1))
    for name, times in rows.items():
        c = {b: d / s for b, (d, s) in times.items()}
        print(f"| {name} | " + " | ".join(f"{c[b]:.3f} ({times[b][0] * 1e3:.1f} / {times[b][1] * 1e3:.1f})"
                                           for b in buckets) + f" | {c[buckets[-1]] / c['512-1023']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
