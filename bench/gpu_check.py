"""The GPU proof: attention parity, the whole pipeline on CUDA and decode speed, in one unattended run.

Sections, each in a process of its own under a hard time limit, all inside one budget (465 s on a GPU): build (a random
Llama target, 8 layers, hidden 2048, bf16, with the tokenizer of recipes/tiny/target); parity:random (the runtime's
torch and flashinfer attention backends against each other and against transformers in bf16, with pass marks set from
the noise floor of transformers bf16 vs fp32; then greedy decode tokens/s against transformers ``generate``);
precompute (320 rows of the shipped SGD data, then verify), train (50 steps of the mtp head, bf16 autocast) and eval
(k = 1..4, T = 0 and 1; the measured speedup), each ``python -m mtp_train.cli STAGE`` on a recipe written into the
work directory; parity:smollm2, as parity:random on .cache/smollm2-135m-instruct when it is there (~540 MB, over the
carry limit, so seldom on the GPU machine: then one line says it was skipped). A failed section prints one line
``FAIL section: why``, the run goes on, and the exit status is 1; flashinfer's not running on a GPU is a failure.
The Markdown for bench/RESULTS.md comes last on stdout, and goes to $OUT/gpu_check.md too when $OUT is set.

    python bench/gpu_check.py              # CUDA; without CUDA it says so in one line and exits 0
    python bench/gpu_check.py --cpu-smoke  # the same flow on CPU at tiny sizes (torch backend, k = 1..2)

Device tool: once, here, ``bash bench/gpu_check.sh fetch`` downloads the wheels the GPU machine lacks (flashinfer,
apache-tvm-ffi, pydantic, datasets and small dependencies, ~16 MB) into .whl/ and git-ignores it; then ``run`` with

    command: "bash bench/gpu_check.sh"    carry: [".whl"]    timeout_s: 560
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
TINY = ROOT / "recipes" / "tiny" / "target"
SMOLLM2 = ROOT / ".cache" / "smollm2-135m-instruct"
SGD = ROOT / "data" / "sgd" / "sgd_train_sharegpt.jsonl.gz"


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
    {"data": {"max_rows": 320, "heldout_rows": 32, "max_length": 512},
     "train": {"max_steps": 50, "batch_tokens": 8192, "mixed_precision": "bf16"},
     "eval": {"k": [1, 2, 3, 4], "prompt_sets": ["heldout", "spec_bench"], "max_prompts": 8, "max_new_tokens": 64,
              "batch_size": 8}},
    465, {"build": 60, "parity:random": 300, "precompute": 90, "train": 120, "eval": 150, "parity:smollm2": 150},
)
SMOKE = Size(
    dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
         max_position_embeddings=512),
    (5, 17, 40), (2, 8, 8),
    {"data": {"max_rows": 24, "heldout_rows": 4, "max_length": 128},
     "train": {"max_steps": 3, "batch_tokens": 1024, "mixed_precision": "no"},
     "eval": {"k": [1, 2], "prompt_sets": ["heldout"], "max_prompts": 2, "max_new_tokens": 8, "batch_size": 2}},
    600,
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


def parity(work: Path, size: Size, smoke: bool, which: str) -> list[str]:
    """The backends against each other and against transformers, then throughput; returns the failed checks."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    root = work / "target" if which == "random" else SMOLLM2
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    backends = ["torch"] if smoke else ["torch", "flashinfer"]
    vocab = json.loads((root / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in size.seq_lens]
    batch, prompt_len, new = size.decode
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    failures, logprobs, speed, outputs = [], {}, {}, {}

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
            engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=()))
            greedy = SamplingParams(max_new_tokens=new, stop_token_ids=())
            results, t_gen = _timed(lambda: engine.generate(prompts, greedy), device)
            outputs[name] = [r.tokens for r in results]
            speed[f"runtime, {name} backend"] = (sum(size.seq_lens) / t_score, batch * new / t_gen)
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
    print(f"| {'fp32' if smoke else 'bf16'}: {len(seqs)} packed sequences, {sum(size.seq_lens):,} tokens | top-1 "
          f"agreement | mean KL | max top-1 log-prob gap | identical greedy outputs ({batch} x {new} tokens) |\n"
          f"|---|---:|---:|---:|---:|\n| noise floor: transformers {'fp32 (none)' if smoke else 'bf16 vs fp32'} | "
          f"{floor[0]:.4f} | {floor[1]:.2e} | {floor[2]:.4f} | |\n"
          f"| pass marks | >= {limits[0]:.4f} | <= {limits[1]:.2e} | <= {limits[2]:.4f} | |")
    for a, b in pairs:
        agree, kl, gap = _compare(logprobs[a], logprobs[b])
        same = sum(x == y for x, y in zip(outputs[a], outputs[b]))
        print(f"| {a} vs {b} | {agree:.4f} | {kl:.2e} | {gap:.4f} | {same}/{batch} |")
        if agree < limits[0] or kl > limits[1] or gap > limits[2]:
            failures.append(f"{a} vs {b}: top-1 agreement {agree:.4f}, mean KL {kl:.2e}, top-1 log-prob gap "
                            f"{gap:.4f}: beyond the pass marks")
    print(f"\n| decoder | score() tok/s | greedy decode tok/s (batch {batch}, {prompt_len}-token prompts, {new} new) "
          "| decode vs transformers |\n|---|---:|---:|---:|")
    base = speed["transformers generate"][1]
    for name, (s, d) in speed.items():
        print(f"| {name} | {'-' if s is None else f'{s:,.0f}'} | {d:,.0f} | x{d / base:.2f} |")
    print()
    (work / f"parity-{which}.json").write_text(json.dumps({"ran": sorted(logprobs)}))
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


def write_recipe(work: Path, size: Size, backend: str) -> Path:
    r = size.recipe
    recipe = {
        "output_dir": str(work / "run"), "seed": 0, "threads": 1 if r["train"]["mixed_precision"] == "no" else None,
        "target": {"path": str(work / "target"), "dtype": "auto", "attention_backend": backend},
        "data": {"train": [str(SGD)], "format": "sharegpt", **r["data"]},
        "precompute": {"layers": [-1], "topk": 32, "shard_tokens": 65536, "batch_tokens": 16384},
        "head": {"kind": "mtp", "num_layers": 1},
        "train": {"lr": 1e-3, "warmup_steps": 10, "unroll": 2, "val_every": r["train"]["max_steps"],
                  "save_every": r["train"]["max_steps"], "wandb_mode": "disabled", **r["train"]},
        "eval": {"temperatures": [0.0, 1.0], **r["eval"]},
    }
    (work / "recipe.yaml").write_text(json.dumps(recipe, indent=1) + "\n")  # JSON is YAML
    return work / "recipe.yaml"


def summary(stage: str, run: Path, size: Size, out: str) -> tuple[str, list[str]]:
    """A stage's outcome in Markdown, read from what it wrote, and the problems it shows."""
    if stage == "precompute":
        rows = size.recipe["data"]["max_rows"]
        return f"Precompute: {rows} rows of {SGD.relative_to(ROOT)}.\n\n```\n{out.strip()}\n```\n", []
    if stage == "train":
        config = json.loads((run / "heads" / "mtp" / "config.json").read_text())
        log = [json.loads(ln) for ln in (run / "train_log.mtp.jsonl").read_text().splitlines() if ln.strip()]
        t, v = size.recipe["train"], config["validation"]
        return (f"Train: mtp head, {config['steps']} steps (mixed precision {t['mixed_precision']}, at most "
                f"{t['batch_tokens']:,} tokens a step), loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}; held-out "
                f"loss {v['val_loss']}, top-1 {v['val_top1']}, simulated tau {v['val_tau']}.\n"), []
    r, e = json.loads((run / "eval" / "report.json").read_text()), size.recipe["eval"]
    lines = [f"Eval: speculative decoding with the mtp head, {r['settings'].get('num_prompts', '?')} prompts from "
             f"{', '.join(e['prompt_sets'])}, batch {e['batch_size']}, {e['max_new_tokens']} new tokens.\n",
             "| k | T | tau | alpha | c | expected | measured | lossless |\n|---:|---:|---:|---|---:|---:|---:|---|"]
    lines += [f"| {p['k']} | {p['temperature']:g} | {p['tau']:.3f} | {[round(a, 3) for a in p['alpha']]} | "
              f"{p['draft_cost_ratio']:.3f} | x{p['expected_speedup']:.2f} | x{p['measured_speedup'] or math.nan:.2f}"
              f" | {p['lossless']} |" for p in r["sweep"]]
    lines += [f"\nHeadline (k={r['k']}, T={r['temperature']:g}): tau {r['tau']:.3f}, measured speedup "
              f"x{r['measured_speedup'] or math.nan:.2f} over plain decoding in the runtime; lossless {r['lossless']}; "
              f"runtime vs trainer validation loss {r['val_loss']} vs {r['trainer_val_loss']} (mismatch "
              f"{r['val_mismatch']}).\n"]
    problems = []
    if r["lossless"] is False:
        problems.append(f"speculative output differs from plain decoding at T=0: {r.get('lossless_detail')}")
    if r["val_mismatch"]:
        problems.append(f"the runtime's and the trainer's validation differ beyond {r['val_tolerance']}")
    return "\n".join(lines), problems


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

    md += [section("build")[1], "### Attention backends: random target\n", section("parity:random")[1]]
    facts = work / "parity-random.json"
    backend = "flashinfer" if facts.is_file() and "flashinfer" in json.loads(facts.read_text())["ran"] else "torch"
    if not smoke and backend == "torch":  # never a silent fallback: a JIT build past its limit is a failure
        runner.fail("parity:random", "flashinfer did not run (missing, or its JIT build failed or ran too long)")
    recipe, run = str(write_recipe(work, size, backend)), work / "run"
    md.append(f"### Pipeline on the random target ({backend} attention backend)\n")
    stages = {"precompute": [cli + ["precompute", recipe], cli + ["verify", str(run / "features")]],
              "train": [cli + ["train", recipe]], "eval": [cli + ["eval", recipe]]}
    for name, commands in stages.items():
        ok, out = section(name, commands)
        try:
            text, problems = summary(name, run, size, out.replace(str(work), ".")) if ok else ("", [])
        except (OSError, KeyError, ValueError, IndexError, TypeError) as e:
            text, problems = "", [f"its outputs could not be read: {_why(e)}"]
        md.append(text)
        for why in problems:
            runner.fail(name, why)
    md.append("### SmolLM2-135M-Instruct\n")
    if not smoke and (SMOLLM2 / "config.json").is_file():
        md.append(section("parity:smollm2")[1])
    else:  # ~540 MB: over the device tool's carry limit
        why = "not in --cpu-smoke" if smoke else f"{SMOLLM2.relative_to(ROOT)} is not here (`make smollm2` fetches it)"
        print(f"SKIP parity:smollm2: {why}", flush=True)
        md.append(f"Skipped: {why}.\n")
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
            else:
                failures = parity(args.work, size, args.cpu_smoke, args.section.split(":")[1])
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
