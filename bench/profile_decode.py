"""Where a decode step's time goes: torch's profiler over plain greedy decode steps, grouped by what the ops do.

    .venv/bin/python bench/profile_decode.py [--model PATH] [--batch 1 8] [--steps 24] [--threads 2] [--copy packed]

For each batch size: prompts of 16–127 tokens are prefilled and decoded a few steps untimed (warm-up), then
``--steps`` decode steps (every sequence one token) are profiled. Each aten op's **self** CPU time is put in one
group (matmuls, attention, KV writes, KV gathers, norms, RoPE and elementwise, sampling and the lm_head's softmax
side, copies and indexing, other ops); "Python and dispatch" is the wall time of the steps minus the ops' total
(the scheduler, batch building, plan construction, the module calls between ops). Percentages are of the wall
time; with 2 threads an op's self time is its time on the calling thread, so the groups add up to the wall time.

**The floor.** A decode step must read every weight once (``B`` tokens share the read) and do ``2 x params x B``
flops. The script measures this machine's read bandwidth (a ``sum`` over 1 GiB) and its fp32 matmul rate at the
step's own shapes, and prints the step time that either alone would allow: the fastest any implementation (this
runtime, transformers, vLLM) can decode here, and so what bounds a ratio between them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402
from mtp_train.runtime.machine import read_bandwidth  # noqa: E402
SMOLLM2 = REPO / ".cache" / "smollm2-135m-instruct"

GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("decoder layers in one call (decode_layer.cpp)", ("mtp_decode_layer::",)),
    ("matmuls (linear, mm, bmm, the small-row kernel)", ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear",
                                                        "aten::matmul", "mtp_small_rows::linear")),
    ("attention (SDPA, paged_attention.cpp)", ("aten::_scaled_dot_product", "aten::scaled_dot_product",
                                               "aten::_flash_attention", "mtp_paged_attention::")),
    ("KV writes (index_copy_)", ("aten::index_copy",)),
    ("KV gathers (index_select)", ("aten::index_select",)),
    ("norms (rms_norm)", ("aten::rms_norm", "aten::_fused_rms_norm", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("elementwise (RoPE, SiLU, residuals)", ("aten::mul", "aten::add", "aten::silu", "aten::neg", "aten::cat",
                                             "aten::cos", "aten::sin", "aten::sub", "aten::div")),
    ("sampling (argmax, softmax)", ("aten::argmax", "aten::softmax", "aten::_softmax", "aten::topk",
                                    "aten::multinomial", "aten::log_softmax")),
    ("copies, views and indexing", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::index", "aten::view",
                                    "aten::reshape", "aten::transpose", "aten::slice", "aten::select",
                                    "aten::contiguous", "aten::clone", "aten::split", "aten::chunk",
                                    "aten::narrow", "aten::as_strided", "aten::expand", "aten::unsqueeze",
                                    "aten::empty", "aten::zeros", "aten::fill_", "aten::arange", "aten::where",
                                    "aten::masked_fill", "aten::lift_fresh", "aten::tensor", "aten::item",
                                    "aten::_local_scalar_dense", "aten::repeat_interleave", "aten::clamp",
                                    "aten::lt", "aten::le", "aten::gt", "aten::ge", "aten::eq", "aten::bitwise_and",
                                    "aten::embedding", "aten::remainder", "aten::floor_divide", "aten::max",
                                    "aten::resize_", "aten::new_empty", "aten::empty_strided", "aten::zero_",
                                    "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::t",
                                    "aten::permute", "aten::stack", "aten::index_put_", "aten::cumsum")),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other ops"


def profile(root: Path, batch: int, steps: int, copy: str) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """Wall seconds of ``steps`` decode steps at ``batch``, self seconds per group, and the top ops; ``copy``: the
    small-batch layout's copies (``packed``, ``transposed``; ``none`` turns the layout off)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.small_batch import tune

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 128, (batch,), generator=g)]
    engine = Engine.from_pretrained(root, small_batch_layout=False)
    if copy != "none":
        tune(engine.model, copy)
    params = SamplingParams(max_new_tokens=steps + 16, stop_token_ids=())
    with torch.inference_mode():
        scheduler, _ = engine.start(prompts, params)
        while any(s.cached < len(s.tokens) - 1 for s in scheduler.running) or scheduler.waiting:
            engine.step(scheduler)  # prefill
        for _ in range(4):
            engine.step(scheduler)  # warm-up decode steps
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step(scheduler)
            wall = time.perf_counter() - start
    by_group: dict[str, float] = {}
    ops = []
    for evt in prof.key_averages():
        if not evt.key.startswith(("aten::", "mtp_")):
            continue
        seconds = evt.self_cpu_time_total / 1e6
        by_group[group_of(evt.key)] = by_group.get(group_of(evt.key), 0.0) + seconds
        ops.append((evt.key, seconds))
    ops.sort(key=lambda x: -x[1])
    return wall, by_group, ops[:12]


def floor_ms(root: Path, batch: int) -> tuple[float, float, float, float]:
    """``(bandwidth GB/s, matmul GFLOP/s, ms to read the weights once, ms for the step's matmul flops)``."""
    from mtp_train.models.checkpoint import load_transformer

    model = load_transformer(root)
    params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not model.tok_embeddings.weight)
    if model.cfg.tie_word_embeddings:
        params += model.output.weight.numel()  # the tied matrix is read once, as the lm_head
    bandwidth = read_bandwidth() / 1e9  # a sum over 1 GiB, as runtime_bench measures it
    layer = model.layers[0]
    weights = [layer.attention.wqkv.weight, layer.attention.wo.weight, layer.feed_forward.w_gate_up.weight,
               layer.feed_forward.w_down.weight]
    x = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    start, flops = time.perf_counter(), 0
    for _ in range(20):
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)
            flops += 2 * batch * w.numel()
    gflops = flops / (time.perf_counter() - start) / 1e9  # includes each matmul's own weight read
    return bandwidth, gflops, 1000 * params * 4 / (bandwidth * 1e9), 1000 * 2 * params * batch / (gflops * 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=SMOLLM2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copy", choices=["packed", "transposed", "none"], default="packed",
                   help="the small-batch layout's weight copies (packed: the small-row kernel, the default on CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    print(f"{args.model.name}, torch {torch.__version__}, {args.threads} threads, fp32, weight copies: {args.copy}; "
          f"{args.steps} decode steps profiled after 4 warm-up steps\n")
    for batch in args.batch:
        wall, by_group, ops = profile(args.model, batch, args.steps, args.copy)
        step_ms = 1000 * wall / args.steps
        print(f"### batch {batch}: {step_ms:.1f} ms per decode step ({batch * args.steps / wall:.0f} tok/s, "
              "under the profiler)\n")
        print("| group | ms per step | share |\n|---|---:|---:|")
        rows = sorted(by_group.items(), key=lambda x: -x[1])
        python = wall - sum(by_group.values())
        for group, seconds in rows + [("Python and dispatch (wall - ops)", python)]:
            print(f"| {group} | {1000 * seconds / args.steps:.2f} | {100 * seconds / wall:.0f}% |")
        bandwidth, gflops, read_ms, flop_ms = floor_ms(args.model, batch)
        print(f"\nFloor: {bandwidth:.1f} GB/s read bandwidth -> {read_ms:.1f} ms to read float32 weights once; "
              f"{gflops:.1f} GFLOP/s at the layer's matmul shapes (batch {batch}) -> {flop_ms:.1f} ms of matmuls; "
              f"the step above is {step_ms / max(read_ms, flop_ms):.2f}x the larger.")
        print("\nTop ops by self time: " + ", ".join(f"`{k}` {1000 * s / args.steps:.2f} ms" for k, s in ops) + "\n")


if __name__ == "__main__":
    main()
