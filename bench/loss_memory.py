"""Peak memory of the loss's vocabulary terms, one forward + backward: unchunked against the library's chunks.

- unchunked: the formula as it was before chunking (kept here only as the baseline): a full ``[tokens, vocab]``
  fp32 log-softmax of the draft (and of the target for ``--teacher exact``), held for backward;
- chunked: ``mtp_train.train.loss.vocab_terms``, the code ``head_loss`` runs, ``chunk_rows(vocab)`` rows at a time.

The input is a random ``[tokens, hidden]`` fp32 "head output" that requires grad, and a frozen random lm_head
(``FrozenTarget``, embedding tied to it so that it costs nothing more). The loss is ``kl.mean()``, as in the
trainer, plus the draft's top-1 count. Each variant runs in its own fresh subprocess; its peak is the process's
peak resident set (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs`` after setup) minus
its resident set just before the measured call, so the lm_head, the inputs and the interpreter do not count.
Both write the loss and the gradient w.r.t. the input; the parent prints their largest differences.

    .venv/bin/python bench/loss_memory.py [--tokens 8192] [--vocab 128256] [--hidden 4096] [--teacher topk]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

from mtp_train.heads.frozen import FrozenTarget  # noqa: E402
from mtp_train.models.config import ModelConfig  # noqa: E402
from mtp_train.train.loss import chunk_rows, kl_topk, vocab_terms  # noqa: E402

MIB = 2**20
VARIANTS = ("unchunked", "chunked")


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmHWM", "VmRSS")}


def _reset_peak() -> bool:
    """Sets VmHWM back to the current VmRSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def unchunked(frozen: FrozenTarget, x: torch.Tensor, teacher: list[torch.Tensor], exact: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss's vocabulary terms before chunking: ``x [n, H]`` -> KL ``[n]``, draft and target top-1 ``[n]``."""
    draft_logp = torch.log_softmax(frozen.logits(x), dim=-1)
    if exact:
        target_logp = torch.log_softmax(frozen.logits(frozen.final_norm(teacher[0])), dim=-1)
        kl = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
        target_top1 = target_logp.argmax(-1)
    else:
        kl = kl_topk(draft_logp, *teacher)
        target_top1 = teacher[1][:, 0]
    return kl, draft_logp.argmax(-1), target_top1


def _inputs(tokens: int, vocab: int, hidden: int, topk: int, exact: bool
            ) -> tuple[FrozenTarget, torch.Tensor, list[torch.Tensor]]:
    """Seeded random inputs; nothing here is as large as a ``[tokens, vocab]`` tensor."""
    g = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    cfg = ModelConfig("llama", vocab, hidden, 4 * hidden, 1, 1, 1, hidden, 1e-6, 4096)
    frozen = FrozenTarget(cfg, lm_head, torch.ones(hidden), lm_head)
    x = (4 * torch.randn(tokens, hidden, generator=g)).requires_grad_(True)
    if exact:
        return frozen, x, [x.detach() + 2 * torch.randn(tokens, hidden, generator=g)]  # agrees on some top-1
    # K distinct ids per row, log-probs of a K-bucket head holding 90% of the mass, the rest in the tail
    ids = (torch.randint(0, vocab, (tokens, 1), generator=g) + torch.arange(topk) * (vocab // topk)) % vocab
    lp = torch.log_softmax(2 * torch.randn(tokens, topk, generator=g), -1) + torch.log(torch.tensor(0.9))
    return frozen, x, [lp.bfloat16().float(), ids, torch.full((tokens,), 0.1).log()]


def child(args: argparse.Namespace) -> None:
    """One variant: measure, then write ``result.json`` and the gradient into ``args.out``."""
    torch.set_num_threads(args.threads)
    exact = args.teacher == "exact"
    frozen, x, teacher = _inputs(args.tokens, args.vocab, args.hidden, args.topk, exact)
    fn = vocab_terms if args.child == "chunked" else unchunked
    reset = _reset_peak()
    before = _status_kib()["VmRSS"]
    start = time.perf_counter()
    kl, draft_top1, target_top1 = fn(frozen, x, teacher, exact)[:3]
    loss = kl.mean()
    correct = int((draft_top1 == target_top1).sum())
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _status_kib()["VmHWM"] - before
    out = Path(args.out)
    save_file({"grad": x.grad}, str(out / f"{args.child}.safetensors"))
    result = {"peak_mib": peak / 1024, "loss": float(loss.detach()), "correct": correct, "seconds": seconds,
              "peak_reset": reset}
    (out / f"{args.child}.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="masked rows in the loss")
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--topk", type=int, default=32, help="K of the top-K teacher")
    p.add_argument("--teacher", choices=("topk", "exact"), default="topk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    print(machine_line(), flush=True)
    sizes = ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
             "--topk", str(args.topk), "--teacher", args.teacher, "--threads", str(args.threads)]
    results, grads = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:  # one at a time, each in a fresh process
            proc = subprocess.run([sys.executable, __file__, *sizes, "--child", variant, "--out", tmp])
            if proc.returncode:
                raise SystemExit(f"{variant}: the measurement failed (exit status {proc.returncode})")
            results[variant] = json.loads((Path(tmp) / f"{variant}.json").read_text())
            grads[variant] = load_file(str(Path(tmp) / f"{variant}.safetensors"))["grad"]
    base, new = results["unchunked"], results["chunked"]
    rows = chunk_rows(args.vocab)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, teacher {args.teacher}"
          + (f" (K = {args.topk})" if args.teacher == "topk" else "")
          + f"; chunks of {rows} rows ({-(-args.tokens // rows)} chunks); peak = VmHWM - VmRSS before the call"
          + ("" if all(r["peak_reset"] for r in results.values()) else " (VmHWM could not be reset: setup counts)"))
    print()
    print("| variant | tokens | vocab | hidden | peak MiB | ratio | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant, r in results.items():
        print(f"| {variant} | {args.tokens:,} | {args.vocab:,} | {args.hidden:,} | {r['peak_mib']:,.0f} "
              f"| {r['peak_mib'] / base['peak_mib']:.3f} | {r['seconds']:.1f} |")
    print()
    grad_diff = float((grads["chunked"] - grads["unchunked"]).abs().max())
    print(f"loss {base['loss']:.6f} / {new['loss']:.6f} (max abs diff {abs(base['loss'] - new['loss']):.2e}); "
          f"input gradient max abs diff {grad_diff:.2e} (max abs {float(grads['unchunked'].abs().max()):.2e}); "
          f"top-1 correct {base['correct']} / {new['correct']}")
    ratio = new["peak_mib"] / base["peak_mib"]
    print(f"goal chunked peak <= 1/8 of unchunked: {'met' if ratio <= 1 / 8 else 'not met'} (1/{1 / ratio:.1f})")


if __name__ == "__main__":
    main()
