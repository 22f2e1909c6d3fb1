"""The GPU proof: FlashInfer's kernels, attention parity, a probe at 70B width, the whole pipeline on CUDA and decode
speed, in one unattended run.

Sections, each in a process of its own under a hard time limit; the limits add up to the run's budget (420 s on a
GPU, so that with the wheels' install the run ends inside 8 minutes). FlashInfer's come first: kernels (every kernel
the runtime plans, prebuilt by bench/flashinfer_aot.py and loaded, or compiled here, each kind of step once against
dense attention: ``gpu_kernels.py``); build (a random Llama target, 8 layers, hidden 2048, bf16, tiny's tokenizer);
parity:random (the torch and flashinfer backends against each other and against transformers in bf16, fresh and
over cached pages, through a tree mask (``gpu_paged.py``), pass marks from transformers' bf16-vs-fp32 noise floor;
greedy decode tokens/s against transformers ``generate``; the host syncs of a plain, speculative, DFlash and tree
step, at most ``SYNC_BUDGET`` each); probe:70b (Llama-3.3-70B's widths against ``mtp_train.memory``'s plan:
``gpu_probe.py``); precompute (320 SGD rows, answers regenerated, then verify), train (30 bf16 steps of the mtp
head), train:eagle3 and eval (k = 1..4, T = 0 and 1), each through the CLI; then ``gpu_pipeline.extra_stages``:
DeepSpeed ZeRO-2 in bf16, online training on FP8 features, the tiny DeepSeek target, TP = 2 through torchrun. A
failed section prints ``FAIL section: why``, the run goes on, the exit status is 1; flashinfer's not running on a
GPU is a failure. The Markdown for bench/RESULTS.md comes last on stdout (and in $OUT/gpu_check.md).

    python bench/gpu_check.py              # CUDA; without CUDA it says so in one line and exits 0
    python bench/gpu_check.py --cpu-smoke  # the same flow on CPU at tiny sizes (torch backend, k = 1..2)

Device tool: once, here, ``bash bench/gpu_check.sh fetch`` downloads the wheels the GPU machine lacks into .whl/ and
builds FlashInfer's kernels into .whl/aot/ (bench/flashinfer_aot.py); then ``run`` with

    command: "bash bench/gpu_check.sh"    carry: [".whl"]    timeout_s: 540
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the project, installed or not
from gpu_kernels import run_kernels  # noqa: E402  (bench/, this script's folder)
from gpu_paged import fresh_rows, paged_logprobs, step_syncs  # noqa: E402
from gpu_pipeline import extra_stages, summary, write_recipe  # noqa: E402
from gpu_probe import run_probe  # noqa: E402
from mtp_train.runtime.syncs import SYNC_BUDGET  # noqa: E402
from bench.machine import machine_line  # noqa: E402
TINY = ROOT / "recipes" / "tiny" / "target"
PAGED_STEPS, PAGED_VERIFY = 6, 4  # decode steps over cached pages, then the tokens of one verify step
DECODE_PASS = 1.0  # the runtime's greedy decode must be at least as fast as transformers generate on a GPU


@dataclass(frozen=True)
class Size:
    """Everything that differs between the GPU check and the CPU smoke run."""
    model: dict[str, int]  # LlamaConfig fields of the random target
    seq_lens: tuple[int, ...]  # parity: sequences scored packed
    decode: tuple[int, int, int]  # parity: batch, prompt tokens, new tokens
    recipe: dict[str, dict]  # the pipeline recipe's data, train and eval fields that differ
    budget_s: int
    guards: dict[str, int] = field(default_factory=dict)  # seconds per section; 120 where not given


GPU = Size(
    dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, intermediate_size=5632,
         max_position_embeddings=4096),
    (17, 300, 1000, 64, 513, 2000, 5, 128), (8, 128, 128),
    {"data": {"max_rows": 320, "heldout_rows": 32, "max_length": 512, "regenerate": True,
              "sampling": {"max_new_tokens": 32}},
     "train": {"max_steps": 30, "batch_tokens": 8192, "mixed_precision": "bf16"},
     "eval": {"k": [1, 2, 3, 4], "prompt_sets": ["heldout", "spec_bench"], "max_prompts": 8, "max_new_tokens": 32,
              "batch_size": 8}},
    420, {"kernels": 40, "build": 20, "parity:random": 90, "probe:70b": 35, "precompute": 30, "train": 25,
          "train:eagle3": 25, "eval": 45, "train:deepspeed": 25, "train:online-fp8": 30, "pipeline:deepseek": 30,
          "precompute:tp2": 25},
)
SMOKE = Size(
    dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
         max_position_embeddings=512),
    (5, 17, 40), (2, 8, 8),
    {"data": {"max_rows": 24, "heldout_rows": 4, "max_length": 128, "regenerate": True,
              "sampling": {"max_new_tokens": 8}},
     "train": {"max_steps": 3, "batch_tokens": 1024, "mixed_precision": "no"},
     "eval": {"k": [1, 2], "prompt_sets": ["heldout"], "max_prompts": 2, "max_new_tokens": 8, "batch_size": 2}},
    900,
)


def build(work: Path, size: Size, smoke: bool) -> None:
    """A random Llama target with the tiny target's tokenizer, saved where the recipe points."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = json.loads((TINY / "config.json").read_text())
    ids = {key: tiny[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(**size.model, **ids, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits with a std of about 3 rather than 0.9 (or 0.16 in the smoke run)
        model.lm_head.weight.mul_(3.0 / (config.initializer_range * config.hidden_size**0.5))
    root = work / "target"
    model.to(torch.float32 if smoke else torch.bfloat16).save_pretrained(root)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY / name, root / name)
    shape = ", ".join(f"{key} {value}" for key, value in {**size.model, "vocab_size": config.vocab_size}.items())
    print(f"Target: random Llama ({shape}), {model.num_parameters() / 1e6:.0f}M parameters, tiny's tokenizer.\n")


def _timed(fn, device: str):
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _compare(a, b) -> tuple[float, float, float]:
    """Top-1 agreement, mean KL(a || b) and the largest gap in a's top-1 log-prob, for log-probs ``[T, V]``."""
    top = a.argmax(-1, keepdim=True)
    agree = (top == b.argmax(-1, keepdim=True)).float().mean().item()
    kl = (a.exp() * (a - b)).sum(-1).mean().item()
    return agree, kl, (a.gather(1, top) - b.gather(1, top)).abs().max().item()


def parity(work: Path, size: Size, smoke: bool) -> list[str]:
    """The backends against each other and against transformers, then throughput; returns the failed checks."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    root = work / "target"
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    backends = ["torch"] if smoke else ["torch", "flashinfer"]
    vocab = json.loads((root / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in size.seq_lens]
    batch, prompt_len, new = size.decode
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    continuation = [torch.randint(0, vocab, (PAGED_STEPS + PAGED_VERIFY,), generator=g).tolist() for _ in prompts]
    failures, logprobs, speed, outputs, paged, syncs = [], {}, {}, {}, {}, {}

    def reference(dt):
        model = AutoModelForCausalLM.from_pretrained(root, dtype=dt, attn_implementation="sdpa").to(device).eval()
        with torch.no_grad():
            return model, torch.cat([model(torch.tensor([s], device=device)).logits[0].float().log_softmax(-1)
                                     for s in seqs])

    hf, logprobs["transformers"] = reference(dtype)
    # The noise floor is transformers in bf16 against itself in fp32. Two bf16 implementations may differ by about
    # twice as much (four times in KL, which is quadratic in the error), plus a little.
    floor = (1.0, 0.0, 0.0) if smoke else _compare(logprobs["transformers"], reference(torch.float32)[1])
    limits = (1 - 2 * (1 - floor[0]) - 0.005, 4 * floor[1] + 1e-5, 2 * floor[2] + 0.02)
    with torch.no_grad():
        ids = torch.tensor(prompts, device=device)

        def hf_generate(n: int):
            return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=hf.config.pad_token_id or 0)

        hf_generate(4)
        out, seconds = _timed(lambda: hf_generate(new), device)
    outputs["transformers"] = out[:, prompt_len:].tolist()
    speed["transformers generate"] = (None, batch * new / seconds)
    del hf
    for name in backends:
        engine = None
        try:
            engine = Engine.from_pretrained(root, dtype=dtype, device=device, backend=name, max_batch_tokens=16384)
            scored = engine.score(seqs, layers=[-1], topk=8)  # the first call compiles flashinfer's kernels
            _, t_score = _timed(lambda: engine.score(seqs, layers=[-1], topk=32), device)
            with torch.no_grad():
                logprobs[name] = engine.model.logits(scored.hidden[:, -1].to(device)).float().log_softmax(-1)
            paged[name] = (paged_logprobs(engine, prompts, continuation, PAGED_STEPS),
                           fresh_rows(engine, prompts, continuation, PAGED_STEPS),
                           paged_logprobs(engine, prompts, continuation, PAGED_STEPS, tree=True))
            engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=()))
            greedy = SamplingParams(max_new_tokens=new, stop_token_ids=())
            results, t_gen = _timed(lambda: engine.generate(prompts, greedy), device)
            outputs[name] = [r.tokens for r in results]
            speed[f"runtime, {name} backend"] = (sum(size.seq_lens) / t_score, batch * new / t_gen)
            if not smoke:  # torch's sync debug mode needs CUDA; CI counts the same on the fake device
                syncs[name] = step_syncs(engine, prompts)
        except Exception as e:  # one backend's failure still lets the other be measured
            traceback.print_exc()
            failures.append(f"{name} backend: {_why(e)}")
        finally:
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    pairs = [(b, "transformers") for b in backends if b in logprobs]
    if {"torch", "flashinfer"} <= logprobs.keys():
        pairs.append(("flashinfer", "torch"))
    rows = {f"{b} over cached pages": p for b, (p, _, _) in paged.items()}
    rows.update({f"{b} fresh": f for b, (_, f, _) in paged.items()})
    rows.update({f"{b} tree-masked verify": t for b, (_, _, t) in paged.items()})
    pairs += [(f"{b} over cached pages", f"{b} fresh") for b in paged]
    pairs += [(f"{b} tree-masked verify", f"{b} fresh") for b in paged]
    if {"torch", "flashinfer"} <= paged.keys():
        pairs.append(("flashinfer over cached pages", "torch over cached pages"))
    print(f"| {'fp32' if smoke else 'bf16'}: {len(seqs)} packed sequences, {sum(size.seq_lens):,} tokens | top-1 "
          f"agreement | mean KL | max top-1 log-prob gap | identical greedy outputs ({batch} x {new} tokens) |\n"
          f"|---|---:|---:|---:|---:|\n| noise floor: transformers {'fp32 (none)' if smoke else 'bf16 vs fp32'} | "
          f"{floor[0]:.4f} | {floor[1]:.2e} | {floor[2]:.4f} | |\n"
          f"| pass marks | >= {limits[0]:.4f} | <= {limits[1]:.2e} | <= {limits[2]:.4f} | |")
    for a, b in pairs:
        agree, kl, gap = _compare(logprobs.get(a, rows.get(a)), logprobs.get(b, rows.get(b)))
        same = f"{sum(x == y for x, y in zip(outputs[a], outputs[b]))}/{batch}" if a in outputs else ""
        print(f"| {a} vs {b} | {agree:.4f} | {kl:.2e} | {gap:.4f} | {same} |")
        if agree < limits[0] or kl > limits[1] or gap > limits[2]:
            failures.append(f"{a} vs {b}: top-1 agreement {agree:.4f}, mean KL {kl:.2e}, top-1 log-prob gap "
                            f"{gap:.4f}: beyond the pass marks")
    print(f"\n| decoder | score() tok/s | greedy decode tok/s (batch {batch}, {prompt_len}-token prompts, {new} new) "
          "| decode vs transformers |\n|---|---:|---:|---:|")
    base = speed["transformers generate"][1]
    for name, (s, d) in speed.items():
        print(f"| {name} | {'-' if s is None else f'{s:,.0f}'} | {d:,.0f} | x{d / base:.2f} |")
        if not smoke and name != "transformers generate" and d < DECODE_PASS * base:
            failures.append(f"{name}: greedy decode at x{d / base:.2f} of transformers generate, under the pass "
                            f"mark x{DECODE_PASS}")
    for name, most in syncs.items():
        print(f"Host syncs per step, {name} backend, batch {batch}: {most} (pass mark: at most {SYNC_BUDGET} each)")
        if max(most.values()) > SYNC_BUDGET:
            failures.append(f"{name} backend: {max(most.values())} host syncs in one step, over {SYNC_BUDGET}")
    print(f"\nPaged rows: {batch} sequences, {PAGED_STEPS} decode steps of one token, then a {PAGED_VERIFY}-token "
          f"verify step, over the pages of {prompt_len}-token prompts. Decode pass mark (GPU): x{DECODE_PASS} of "
          "generate.\n")
    (work / "parity-random.json").write_text(json.dumps({"ran": sorted(logprobs)}))
    return failures


class Runner:
    """Runs each section in a process group under min(its guard, what is left of the budget)."""

    def __init__(self, work: Path, budget_s: int, smoke: bool) -> None:
        self.work, self.log = work, work / "gpu_check.log"
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.rows: list[list] = []  # [section, "PASS" or "FAIL: why", seconds]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
                    "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("MTP_TRAIN_PROGRESS_EVERY", "20")
        if smoke:  # DeepSpeed, when installed, is imported by transformers and warns that it found no GPU
            self.env.setdefault("DS_ACCELERATOR", "cpu")

    def run(self, name: str, commands: list[list[str]], guard: int) -> tuple[bool, str]:
        """Run the commands in order: whether all passed, and their stdout. A failure prints ``FAIL name: why``."""
        t0, out = time.monotonic(), ""
        for cmd in commands:
            left = min(guard - (time.monotonic() - t0), self.deadline - time.monotonic())
            if left < 5:
                return self.fail(name, "no time left in the run's budget", t0), out
            with open(self.log, "a") as log:
                log.write(f"\n=== {name}: {' '.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(cmd, cwd=self.work, env=self.env, stdout=subprocess.PIPE, stderr=log,
                                        text=True, start_new_session=True)
                try:
                    stdout, _ = proc.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # its compilers and workers too
                    out += proc.communicate()[0]
                    return self.fail(name, f"stopped by its time limit after {time.monotonic() - t0:.0f}s", t0), out
            out += stdout
            if proc.returncode != 0:
                last = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()][-1]
                why = f"exit status {proc.returncode}: {last.strip().removeprefix('gpu_check: ')[:400]}"
                return self.fail(name, why, t0), out
        self.rows.append([name, "PASS", time.monotonic() - t0])
        return True, out

    def fail(self, name: str, why: str, t0: float | None = None) -> bool:
        """Print the failure line; without ``t0``, mark the section that just ran failed for what its outputs show."""
        print(f"FAIL {name}: {why}", flush=True)
        if t0 is None:
            self.rows[-1][1] = f"FAIL: {why}" if self.rows[-1][1] == "PASS" else f"{self.rows[-1][1]}; {why}"
        else:
            self.rows.append([name, f"FAIL: {why}", time.monotonic() - t0])
        return False


def check(work: Path, smoke: bool) -> int:
    import importlib.metadata as metadata

    import torch

    size = SMOKE if smoke else GPU
    runner = Runner(work, size.budget_s, smoke)
    flashinfer = next(iter(metadata.distributions(name="flashinfer-python")), None)
    device = "CPU (--cpu-smoke)" if smoke else torch.cuda.get_device_name()
    stack = (f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")
             + f", flashinfer {flashinfer.version if flashinfer else 'not installed'}, transformers "
             f"{metadata.version('transformers')}, Python {sys.version.split()[0]}")
    print(f"gpu_check: {device}; {stack}; work directory {work}; budget {size.budget_s}s", flush=True)
    me = [sys.executable, str(Path(__file__).resolve()), "--work", str(work)] + (["--cpu-smoke"] if smoke else [])
    cli = [sys.executable, "-m", "mtp_train.cli"]
    md = [f"## GPU check, {time.strftime('%Y-%m-%d')}: {device}\n", f"{stack}.\n"]

    def section(name: str, commands: list[list[str]] | None = None) -> tuple[bool, str]:
        return runner.run(name, commands or [me + ["--section", name]], size.guards.get(name, 120))

    md += ["### FlashInfer's kernels\n", section("kernels")[1], section("build")[1],
           "### Attention backends: random target\n", section("parity:random")[1],
           "### At Llama-3.3-70B's widths\n", section("probe:70b")[1]]
    facts = work / "parity-random.json"
    backend = "flashinfer" if facts.is_file() and "flashinfer" in json.loads(facts.read_text())["ran"] else "torch"
    if not smoke and backend == "torch":  # never a silent fallback: a JIT build past its limit is a failure
        runner.fail("parity:random", "flashinfer did not run (missing, or its JIT build failed or ran too long)")
    recipe, run = str(write_recipe(work, size.recipe, backend)), work / "run"
    md.append(f"### Pipeline on the random target ({backend} attention backend)\n")
    stages = {"precompute": [cli + ["precompute", recipe], cli + ["verify", str(run / "features")]],
              "train": [cli + ["train", recipe, "eval.compare=[]"]],  # the mtp head alone, then the eagle3 head
              "train:eagle3": [cli + ["train", recipe, "head.kind=eagle3"]],
              "eval": [cli + ["eval", recipe]]}
    for name, commands in stages.items():
        ok, out = section(name, commands)
        try:
            text, problems = summary(name, run, size.recipe, out.replace(str(work), ".")) if ok else ("", [])
        except (OSError, KeyError, ValueError, IndexError, TypeError) as e:
            text, problems = "", [f"its outputs could not be read: {_why(e)}"]
        md.append(text)
        for why in problems:
            runner.fail(name, why)
    md.append("### What a cluster runs besides\n")
    gpus = 0 if smoke else torch.cuda.device_count()
    for name, commands, skipped in extra_stages(work, Path(recipe), cli, smoke, gpus):
        if skipped:
            print(f"SKIP {name}: {skipped}", flush=True)
            md.append(f"- {name}: skipped ({skipped}).")
        else:
            md.append(f"- {name}: {'PASS' if section(name, commands)[0] else 'FAIL'}.")
    md.append("")
    failed = [row for row in runner.rows if row[1] != "PASS"]
    md.append("| section | result | seconds |\n|---|---|---:|")
    md += [f"| {name} | {result} | {seconds:.0f} |" for name, result, seconds in runner.rows]
    md.append(f"\n**{'FAIL' if failed else 'PASS'}**: {len(runner.rows) - len(failed)}/{len(runner.rows)} sections "
              f"passed in {time.monotonic() - runner.start:.0f}s.")
    report = "\n".join(md).replace("\n\n\n", "\n\n")
    print("\n" + report)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_check.md").write_text(report + "\n")
        shutil.copy(runner.log, Path(os.environ["OUT"]) / "gpu_check.log")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the same flow on CPU at tiny sizes")
    parser.add_argument("--work", type=Path, help="work directory, kept (default: a temporary one, kept on failure)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:  # one section, in a process the driver started; the last line on stderr says why it failed
        size, failures = SMOKE if args.cpu_smoke else GPU, []
        try:
            if args.section == "build":
                build(args.work, size, args.cpu_smoke)
            elif args.section == "kernels":
                failures = run_kernels(args.cpu_smoke)
            elif args.section == "probe:70b":
                failures = run_probe(args.cpu_smoke)
            else:
                failures = parity(args.work, size, args.cpu_smoke)
        except Exception as e:
            traceback.print_exc()
            failures = [_why(e)]
        if failures:
            print(f"gpu_check: {'; '.join(failures)}", file=sys.stderr)
        return 1 if failures else 0
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was measured. Run this on a GPU machine (or use --cpu-smoke).")
        return 0
    print(machine_line(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    status = check(work, args.cpu_smoke)
    if status:
        print(f"gpu_check: logs and outputs are in {work}", file=sys.stderr)
    elif args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
