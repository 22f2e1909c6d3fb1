"""How far the top-K KL of the training loss is from the exact KL, for a real target and a trained head.

    .venv/bin/python bench/topk_kl.py --recipe recipes/smollm2.yaml [--head mtp] [--max-tokens 4096]

Needs the recipe's features (``mtp-train precompute``) and a trained head (``mtp-train train``). Over the held-out
sequences, at unrolled step 0 and the loss-masked positions that ``head_loss`` counts there, the exact target
log-probs are ``log_softmax(lm_head(final_norm(h)))`` in fp32 from the stored (pre-norm, last-layer) hidden states,
and the draft log-probs are the head's. For each K the script simulates what precompute stores (the top-K log-probs
rounded to bf16, their ids, and the fp32 log of the exact mass outside them) and compares, per token:

- exact: the full-vocabulary KL(target || draft);
- new: ``kl_topk`` of the loss (K+1 buckets, the rest bucket from the stored fp32 tail);
- old: the previous formula, rest = clamp(1 - sum(exp(bf16 top-K)), 1e-8), which ignores the stored tail
  (its per-token errors against "new" partly cancel in the mean, so their mean absolute value is shown too).

The K+1-bucket KL is a lower bound of the exact one (coarse-graining), so "gap" = exact - new >= 0 up to rounding.
As a check of the simulation, the loss on the stored top-K (K = the features' own) is printed below the table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import machine_line  # noqa: E402
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.recipe import load_recipe
from mtp_train.train.checkpoint import load_head
from mtp_train.train.loss import _step_index, kl_topk
from mtp_train.train.objective import heldout_batches
from mtp_train.features.manifest import target_fingerprint
from mtp_train.features.reader import FeatureReader

KS = (8, 32, 64)
COLUMNS = ("exact", "new", "old", "old_err", "tail", "clamped")
CHUNK = 512  # rows per measurement


def kl_old(draft_logp: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The previous top-K KL: rest masses as 1 - the sum of the (bf16) top-K probabilities, clamped at 1e-8."""
    p = lp.float().exp()
    rest_p = (1.0 - p.sum(-1)).clamp(min=1e-8)
    q_logk = draft_logp.gather(-1, ids)
    rest_q = (1.0 - q_logk.exp().sum(-1)).clamp(min=1e-8)
    return (p * (lp.float() - q_logk)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())


def step0(head, frozen: FrozenTarget, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact target and draft log-probs ``[n, V]`` at step 0's counted positions (``head_loss``'s rows), and the
    batch rows ``[n]`` that hold the target's distribution (for the stored top-K)."""
    rows, cu = _step_index(batch.cu_seqlens, 0)
    hidden_side = frozen.final_norm(batch.hidden) if head.spec.hidden_input == "post_norm" else batch.hidden
    starts = torch.tensor(batch.cu_seqlens[:-1]).repeat_interleave(torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    out = head(frozen.embed(batch.tokens[rows + 1]), hidden_side[rows], rows - starts, cu)
    mask = batch.loss_mask[rows + 2]
    target_rows = rows[mask] + 1
    draft_logp = torch.log_softmax(frozen.logits(head.lm_head_input(out[mask])), dim=-1)
    target_logp = torch.log_softmax(frozen.logits(frozen.final_norm(batch.hidden[target_rows])), dim=-1)
    return target_logp, draft_logp, target_rows


def measure(target_logp: torch.Tensor, draft_logp: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per-token values ``[n]`` of each column for top-K storage simulated from the exact log-probs."""
    values, ids = torch.topk(target_logp, k, dim=-1)
    lp = values.to(torch.bfloat16)  # what precompute stores
    tail = torch.logsumexp(target_logp.scatter(-1, ids, float("-inf")), dim=-1)  # fp32, from the full row
    exact = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
    new, old = kl_topk(draft_logp, lp, ids, tail), kl_old(draft_logp, lp, ids)
    return {"exact": exact, "new": new, "old": old, "old_err": (old - new).abs(), "tail": tail.exp(),
            "clamped": (1.0 - lp.float().exp().sum(-1) <= 0).float()}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=Path("recipes/tiny.yaml"))
    ap.add_argument("--head", default=None, help="head kind under OUTPUT_DIR/heads (default: the recipe's)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="counted step-0 positions to use, at most")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    recipe = load_recipe(args.recipe)
    root = recipe.head_dir(args.head)
    reader = FeatureReader(recipe.features_dir, target=recipe.target.path)
    frozen = FrozenTarget.load(recipe.target.path)
    head = load_head(root, frozen.cfg)
    if head.spec.target_fingerprint != target_fingerprint(recipe.target.path):
        sys.exit(f"{root}: the head was trained for a different target than {recipe.target.path}")

    sums = {k: dict.fromkeys(COLUMNS, 0.0) for k in KS}
    stored_new, n = 0.0, 0
    for batch in heldout_batches(reader, recipe.train.batch_tokens):
        target_logp, draft_logp, target_rows = step0(head, frozen, batch)
        take = min(len(target_rows), args.max_tokens - n)
        target_logp, draft_logp, target_rows = target_logp[:take], draft_logp[:take], target_rows[:take]
        for i in range(0, take, CHUNK):  # bounds the [rows, vocab] temporaries
            for k in KS:
                for name, v in measure(target_logp[i : i + CHUNK], draft_logp[i : i + CHUNK], k).items():
                    sums[k][name] += float(v.double().sum())
        if reader.manifest.topk:  # the loss on what precompute really stored
            stored_new += float(kl_topk(draft_logp, batch.topk_logprobs[target_rows], batch.topk_ids[target_rows],
                                        batch.tail_logprob[target_rows]).double().sum())
        n += take
        if n >= args.max_tokens:
            break
    if n == 0:
        sys.exit(f"{recipe.features_dir}: no held-out loss-masked positions")

    print(f"`.venv/bin/python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}`\n")
    print(f"- target: {recipe.target.path} (vocab {frozen.cfg.vocab_size:,}, {frozen.cfg.num_layers} layers)")
    print(f"- head: {root} ({head.spec.kind}, {head.spec.num_layers} layer(s), "
          f"{sum(p.numel() for p in head.parameters()):,} parameters)")
    print(f"- features: {recipe.features_dir} (stored K = {reader.manifest.topk}); {n:,} held-out loss-masked "
          f"positions of unrolled step 0; torch {torch.__version__}\n")
    print("| K | tokens | exact KL | top-K KL (new) | top-K KL (old, 1-Σ) | mean \\|old-new\\| | gap exact-new | "
          "gap % | mass outside top-K | old rest clamped |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in KS:
        m = {name: s / n for name, s in sums[k].items()}
        gap = m["exact"] - m["new"]
        rel = 100 * gap / m["exact"] if m["exact"] else float("nan")
        print(f"| {k} | {n:,} | {m['exact']:.4f} | {m['new']:.4f} | {m['old']:.4f} | {m['old_err']:.4f} | "
              f"{gap:.4f} | {rel:.1f}% | {m['tail']:.4f} | {100 * m['clamped']:.1f}% |")
    if reader.manifest.topk:
        print(f"\nStored features (K = {reader.manifest.topk}, as precompute wrote them): mean top-K KL (new) "
              f"{stored_new / n:.4f}")


if __name__ == "__main__":
    main()
