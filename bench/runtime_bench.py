"""Runtime throughput against transformers, and against vLLM's CPU build when ``.venv-vllm`` exists, side by side.

    .venv/bin/python bench/runtime_bench.py [--repeats 5] [--threads 1 2] [--new-tokens 64] [--skip tiny,vllm,...]

Rows (each at every ``--threads`` count):

- ``score()``: packed teacher-forced scoring vs a padded transformers forward over the same sequences (tiny target,
  a random Llama h512 x 8 layers; the released targets ``make smollm2 gemma3`` fetched: SmolLM2-135M, Gemma 3 270M);
- greedy decode at batch 1 and 8 vs ``transformers.generate`` (tiny target on random prompts; the released targets on
  12 MT-bench prompts through their chat templates), outputs compared token for token;
- SmolLM2 draft-target decoding at batch 1, k = 2, with SmolLM2 as its own draft (so every draft is accepted and
  the row measures the machinery) vs transformers' assisted generation with the same assistant;
- vLLM's CPU build, plain greedy decode of the same prompts at batch 1 and 8, in its own process, at the thread
  count equal to the cores (it binds its threads to all of them);
- each released target's decode step against this machine's memory bandwidth: the step alone (prefill excluded),
  the bytes it reads (the weights as decode reads them, bf16-packed where the checkpoint's values are bf16, and the
  KV cache), and those bytes per second over the read bandwidth (``mtp_train.runtime.machine``); with the step
  float32 weights would allow at that bandwidth, the floor the issue's goal is stated against.

The first line names the machine (CPU, flags, read bandwidth, versions): figures from another CPU never compare.

**Trustworthy on a shared 2-core machine:** every side gets an untimed warm-up; the repetitions of the two sides
interleave (the order alternating), so that drift hits both alike; each side's figure is the median of its
repetitions with their [min, max]; the ratio is the median of the per-repetition ratios with [min, max]. When a
side's repetitions spread by more than 20% of their median, the row says so instead of giving a ratio. The load
average is recorded before and after each row. vLLM runs in another process (its own torch), so its repetitions
cannot interleave with ours: its row compares medians, and says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import machine_line  # noqa: E402
from mtp_train.runtime.machine import read_bandwidth  # noqa: E402

TINY = REPO / "recipes" / "tiny" / "target"
SMOLLM2 = REPO / ".cache" / "smollm2-135m-instruct"
TARGETS = {"smollm2": ("SmolLM2", SMOLLM2), "gemma3": ("Gemma 3 270M", REPO / ".cache" / "gemma-3-270m")}  # if fetched
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
UNSTABLE = 0.20  # a side whose repetitions spread more than this (of its median) gets no ratio


@dataclass
class Row:
    what: str
    threads: int
    ours: list[float]  # tokens/s per repetition
    ref: list[float]
    ref_name: str
    identical: str = ""
    load: str = ""
    interleaved: bool = True
    outputs: list[list[int]] = field(default_factory=list)  # our tokens per prompt (decode rows)

    def cells(self) -> list[str]:
        def fig(xs: list[float]) -> str:
            return f"{statistics.median(xs):,.1f} [{min(xs):,.1f}, {max(xs):,.1f}]"

        def spread(xs: list[float]) -> float:
            return (max(xs) - min(xs)) / statistics.median(xs)

        noisy = [f"{name} ±{100 * spread(xs) / 2:.0f}%" for name, xs in (("ours", self.ours), (self.ref_name, self.ref))
                 if spread(xs) > UNSTABLE]
        if noisy:
            ratio = "unstable: " + ", ".join(noisy)
        elif self.interleaved:
            pairs = [a / b for a, b in zip(self.ours, self.ref)]
            ratio = f"**{statistics.median(pairs):.2f}x** [{min(pairs):.2f}, {max(pairs):.2f}]"
        else:
            ratio = f"**{statistics.median(self.ours) / statistics.median(self.ref):.2f}x** (medians)"
        return [self.what, str(self.threads), fig(self.ours), f"{self.ref_name}: {fig(self.ref)}", ratio,
                self.identical, self.load]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def interleaved(repeats: int, ours: Callable[[], object], reference: Callable[[], object]) -> tuple[list[float], list[float]]:
    """Wall times of ``repeats`` runs of each side after one untimed warm-up each, alternating which goes first."""
    ours()
    reference()
    t_ours, t_ref = [], []
    for r in range(repeats):
        sides = [(ours, t_ours), (reference, t_ref)]
        for fn, times in sides if r % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return t_ours, t_ref


def random_llama(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(root)
    return root


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(m),), generator=g).tolist() for m in torch.randint(16, 128, (n,), generator=g)]


def mt_bench_prompts(root: Path, n: int = 12) -> list[list[int]]:
    """The first turns of ``n`` MT-bench prompts (category-stratified, as the eval takes them) through the chat template."""
    from transformers import AutoTokenizer

    from mtp_train.eval.prompts import load_prompt_set, render_prompt

    tok = AutoTokenizer.from_pretrained(root)
    return [render_prompt(tok, p.messages) for p in load_prompt_set("mt_bench", max_prompts=n, seed=0)]


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def bench_score(root: Path, name: str, repeats: int, threads: int) -> Row:
    from transformers import AutoModelForCausalLM

    from mtp_train.runtime.engine import Engine

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 4000, (int(n),), generator=g).tolist() for n in torch.randint(64, 512, (16,), generator=g)]
    tokens = sum(map(len, seqs))
    engine = Engine.from_pretrained(root, max_batch_tokens=4096)
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    batches, i = [], 0  # the runtime's token budget per forward; transformers pads each batch to its longest
    while i < len(seqs):
        j, total = i, 0
        while j < len(seqs) and (j == i or total + len(seqs[j]) <= 4096):
            total, j = total + len(seqs[j]), j + 1
        batches.append(left_padded(seqs[i:j], 0))
        i = j

    def reference() -> None:
        with torch.inference_mode():
            for ids, mask in batches:
                hf(input_ids=ids, attention_mask=mask)

    before = load()
    t_ours, t_ref = interleaved(repeats, lambda: engine.score(seqs, layers=[-1], topk=32), reference)
    return Row(name, threads, [tokens / t for t in t_ours], [tokens / t for t in t_ref], "transformers",
               load=f"{before} → {load()}")


def bench_decode(root: Path, name: str, prompts: list[list[int]], batch: int, new_tokens: int, repeats: int,
                 threads: int) -> Row:
    """Plain greedy decode of ``prompts``, ``batch`` at a time on both sides, exactly ``new_tokens`` each."""
    from transformers import AutoModelForCausalLM

    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    engine = Engine.from_pretrained(root)
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    outputs: dict[str, list[list[int]]] = {}

    def ours() -> None:
        outputs["ours"] = [r.tokens for group in groups for r in engine.generate(group, params)]

    def reference() -> None:
        out = []
        with torch.inference_mode():
            for group in groups:
                ids, mask = left_padded(group, 0)
                gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
                out += gen[:, ids.shape[1]:].tolist()
        outputs["ref"] = out

    before = load()
    t_ours, t_ref = interleaved(repeats, ours, reference)
    n = len(prompts) * new_tokens
    same = sum(a == b for a, b in zip(outputs["ours"], outputs["ref"]))
    return Row(f"greedy decode, {name}, batch {batch}", threads, [n / t for t in t_ours], [n / t for t in t_ref],
               "transformers", f"{same}/{len(prompts)}", f"{before} → {load()}", outputs=outputs["ours"])


def bench_draft_target(root: Path, prompts: list[list[int]], new_tokens: int, repeats: int, threads: int) -> Row:
    """Batch 1, k = 2, the target as its own draft, against transformers' assisted generation."""
    from transformers import AutoModelForCausalLM

    from mtp_train.models.checkpoint import load_transformer
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.drafters import DraftModelDrafter
    from mtp_train.runtime.speculative import SpeculativeDecoder

    engine = Engine.from_pretrained(root)
    decoder = SpeculativeDecoder(engine, DraftModelDrafter(engine, load_transformer(root)), 2)
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    outputs: dict[str, list[list[int]]] = {}

    def ours() -> None:
        outputs["ours"] = [decoder.generate([p], params)[0].tokens for p in prompts]

    def reference() -> None:
        out = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                                  do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0, eos_token_id=None)
                out.append(gen[0, len(p):].tolist())
        outputs["ref"] = out

    before = load()
    t_ours, t_ref = interleaved(repeats, ours, reference)
    n = len(prompts) * new_tokens
    same = sum(a == b for a, b in zip(outputs["ours"], outputs["ref"]))
    return Row(f"draft-target k = 2 (SmolLM2 drafting itself), batch 1", threads, [n / t for t in t_ours],
               [n / t for t in t_ref], "transformers assisted", f"{same}/{len(prompts)}", f"{before} → {load()}")


def vllm_decode(root: Path, name: str, prompts: list[list[int]], new_tokens: int, repeats: int, threads: int,
                ours: dict[int, Row]) -> list[Row]:
    """vLLM's CPU build, plain greedy decode at batch 1 and 8 in its own process; compared with our rows' medians."""
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"target": str(root), "prompts": prompts, "max_tokens": new_tokens,
                                   "max_model_len": 2048, "timing": {"repeats": repeats, "batches": sorted(ours)}}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "VLLM_LOGGING_LEVEL": "WARNING"}  # as bench/vllm_check.py runs it; vLLM binds all cores itself
        before = load()
        proc = subprocess.run([str(VLLM_PYTHON), str(REPO / "bench" / "vllm_serve.py"), str(job), str(result)],
                              capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            print(f"vLLM failed: {proc.stderr[-2000:]}", file=sys.stderr)
            return []
        data = json.loads(result.read_text())
    rows = []
    for batch, row in sorted(ours.items()):
        n = len(prompts) * new_tokens
        same = sum(a == b for a, b in zip(data["tokens"][str(batch)], row.outputs))
        rows.append(Row(f"greedy decode, {name}, batch {batch}, vs vLLM", threads, row.ours,
                        [n / t for t in data["times"][str(batch)]], f"vLLM {data['version']}",
                        f"{same}/{len(prompts)}", f"{before} → {load()}", interleaved=False))
    return rows


def decode_bytes(engine, rows: int) -> tuple[int, int]:
    """Bytes of weights a decode step of ``rows`` rows reads as the engine holds them (a layer run in one call reads
    its packed copies; a ``Linear`` its packed or transposed copy where it keeps one for that row count, else its
    weight), and what float32 weights would be."""
    from mtp_train.models.parts import Linear
    from mtp_train.models.transformer import DecoderLayer

    read = fp32 = 0
    one_call = set()
    for layer in engine.model.modules():
        if isinstance(layer, DecoderLayer) and layer.decode_weights is not None and rows <= 8:
            w = layer.decode_weights
            read += sum(t.nbytes for t in (w.wqkv, w.wo, w.w_gate_up, w.w_down))
            one_call |= {id(m) for m in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w_gate_up,
                                         layer.feed_forward.w_down)}
    for m in engine.model.modules():
        if isinstance(m, Linear):
            fp32 += m.weight.numel() * 4
            if id(m) not in one_call:
                product = m.small_rows.get(rows)
                read += getattr(product, "packed", m.weight).nbytes
    return read, fp32


def bandwidth_table(root: Path, name: str, prompts: list[list[int]], new_tokens: int, repeats: int, bandwidth: float
                    ) -> str:
    """A target's decode steps at batch 1 and 8 (prefill excluded) against the read bandwidth: a Markdown table."""
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    from mtp_train.runtime.small_batch import tune

    held = Engine.from_pretrained(root)  # bf16-valued weights packed in bf16, as the runtime holds them
    fp32 = Engine.from_pretrained(root, small_batch_layout=False)
    tune(fp32.model, bf16=False)  # every weight packed in float32
    cfg = held.cfg
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    lines = [f"| decode step, {name} | ms per step | weights read MB (float32 would be) | KV read MB | GB/s | "
             "of the read bandwidth | float32 weights' floor ms | step over that floor |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, (name, engine) in itertools.product((1, 8), (("as held", held), ("float32 weights", fp32))):
        weights, fp32_bytes = decode_bytes(engine, batch)
        times, kv = [], []
        for _ in range(repeats):
            with torch.inference_mode():
                scheduler, seqs = engine.start(prompts[:batch], SamplingParams(max_new_tokens=new_tokens + 2,
                                                                               stop_token_ids=()))
                while any(s.cached < len(s.tokens) - 1 for s in seqs):
                    engine.step(scheduler)  # prefill, and the first token
                engine.step(scheduler)  # one untimed decode step
                kv.append(sum(s.cached for s in seqs) * kv_per_token + new_tokens / 2 * batch * kv_per_token)
                start = time.perf_counter()
                for _ in range(new_tokens):
                    engine.step(scheduler)
                times.append((time.perf_counter() - start) / new_tokens)
                while not scheduler.done:
                    engine.step(scheduler)
        step = statistics.median(times)
        total = weights + statistics.median(kv)
        lines.append(f"| batch {batch}, {name} | {1000 * step:.2f} [{1000 * min(times):.2f}, {1000 * max(times):.2f}] | "
                     f"{weights / 1e6:.0f} ({fp32_bytes / 1e6:.0f}) | {statistics.median(kv) / 1e6:.1f} | "
                     f"{total / step / 1e9:.1f} | **{total / step / bandwidth:.2f}** | "
                     f"{1000 * fp32_bytes / bandwidth:.1f} | {step / (fp32_bytes / bandwidth):.2f}x |")
    return "\n".join(lines)


class Rows(list):
    """The table's rows, each printed as soon as it is measured (a long run killed midway keeps what it measured)."""

    def append(self, row: Row) -> None:
        super().append(row)
        print("| " + " | ".join(row.cells()) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--skip", default="", help="comma-separated: tiny, score, smollm2, gemma3, draft, vllm, bandwidth")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    targets = [(name, root) for key, (name, root) in TARGETS.items()
               if (root / "config.json").is_file() and key not in skip]
    vllm = VLLM_PYTHON.is_file() and "vllm" not in skip
    torch.set_num_threads(max(args.threads))
    bandwidth = read_bandwidth()
    print(f"{machine_line(bandwidth=False)}; read bandwidth {bandwidth / 1e9:.1f} GB/s at {max(args.threads)} threads "
          "(sum over 1 GiB)")
    print(f"fp32 activations; {args.repeats} interleaved repetitions per side after a warm-up; tok/s as median "
          f"[min, max]; decode {args.new_tokens} new tokens per prompt\n")
    print("| what | threads | mtp-train tok/s | reference tok/s | ratio | identical outputs | load avg before → after |")
    print("|---|---:|---:|---:|---:|---:|---|", flush=True)
    rows = Rows()
    for threads in args.threads:
        torch.set_num_threads(threads)
        if "tiny" not in skip:
            if "score" not in skip:
                rows.append(bench_score(TINY, "score(), tiny target (1.8M)", args.repeats, threads))
                with tempfile.TemporaryDirectory() as tmp:
                    rows.append(bench_score(random_llama(Path(tmp)), "score(), random Llama h512 x 8 layers",
                                            args.repeats, threads))
            for batch in (1, 8):
                rows.append(bench_decode(TINY, "tiny target", random_prompts(8, 4), batch, args.new_tokens,
                                         args.repeats, threads))
        for name, root in targets:
            prompts = mt_bench_prompts(root)
            if "score" not in skip:
                rows.append(bench_score(root, f"score(), {name}", args.repeats, threads))
            ours = {}
            for batch in (1, 8):
                ours[batch] = bench_decode(root, name, prompts, batch, args.new_tokens, args.repeats, threads)
                rows.append(ours[batch])
            if vllm and threads == os.cpu_count():  # vLLM's CPU build binds its threads to all the cores
                for row in vllm_decode(root, name, prompts, args.new_tokens, args.repeats, threads, ours):
                    rows.append(row)
            if "draft" not in skip and root == SMOLLM2:
                rows.append(bench_draft_target(root, prompts[:4], args.new_tokens, max(2, args.repeats // 2), threads))
            if "bandwidth" not in skip and threads == max(args.threads):
                print("\n" + bandwidth_table(root, name, prompts, args.new_tokens, args.repeats, bandwidth) + "\n")


if __name__ == "__main__":
    main()
