"""A trained eagle, eagle3 or dflash head exported for vLLM and served by vLLM's CPU build, against this runtime.

    make vllm                                   # once: vLLM's CPU build in its own virtualenv, .venv-vllm/
    .venv/bin/python bench/vllm_check.py RECIPE.yaml [KEY.PATH=VALUE ...] [--k 1 2 3 4] [--format speculators]
                                         [--head imported/NAME]     # vLLM serves the file imported from

For the recipe's trained ``eagle``, ``eagle3`` or ``dflash`` head (``head.kind=...``): ``mtp-train export
--format vllm`` (or ``--format speculators``, an eagle3 head), then the
eval's prompts (the recipe's prompt sets, rendered by its chat template, as token ids) at T = 0 with
``eval.max_new_tokens``:

- vLLM plain, and vLLM with the exported head at each k (``bench/vllm_serve.py``, one process per run, in
  .venv-vllm), its counters from ``llm.get_metrics()``;
- this runtime, plain and speculative with the same head, counted as vLLM counts (:class:`mtp_train.eval.metrics.EngineCounts`).

It prints a Markdown table: (a) vLLM's speculative output against vLLM's plain output, (b) vLLM's mean acceptance
length ``1 + accepted / drafts`` against this runtime's, (c) the accepted counts per draft position; and this
runtime's τ beside them. Each k passes when (a) holds and (b) and every rate of (c) are within 3% (relative). When
``OUTPUT_DIR/eval/report.json`` is this head's report, each k's result is added to it (section "Served by an
engine"). Exit status 1 when a check fails, 2 on bad input (no vLLM environment, no eagle head).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
KV_BYTES = 2 * 2**30  # both sides: VLLM_CPU_KVCACHE_SPACE=2 for vLLM, as much for this runtime

from mtp_train.eval.engine_check import TOLERANCE, build_check  # noqa: E402
from mtp_train.eval.metrics import EngineCounts  # noqa: E402
from mtp_train.errors import UserError  # noqa: E402


def vllm_version(python: Path) -> str:
    proc = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise UserError(f"{python}: vLLM does not import ({(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}); "
                        "run `make vllm` again")
    return proc.stdout.strip()


def serve(python: Path, job: dict, work: Path, name: str) -> dict:
    """One bench/vllm_serve.py run; its log goes to WORK/NAME.log."""
    (work / f"{name}.json").write_text(json.dumps(job))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_BYTES // 2**30),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.run([str(python), str(REPO / "bench" / "vllm_serve.py"), str(work / f"{name}.json"),
                               str(work / f"{name}.out.json")], stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=1200)
    if proc.returncode != 0:
        tail = (work / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"vLLM run {name} failed (exit {proc.returncode}): {' | '.join(tail)[:600]}")
    return json.loads((work / f"{name}.out.json").read_text())


def runtime_runs(recipe, ks: list[int], head: Path) -> tuple[list, list[list[int]], list[list[int]], dict]:
    """This runtime on the eval's prompts with the head at ``head``: the prompts, their token ids, plain greedy
    outputs, and per k the speculative outputs, the vLLM-convention counts and τ."""
    import torch

    from mtp_train.eval.metrics import engine_counts, pooled_tau
    from mtp_train.eval.run import eval_prompts, request_traces
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.drafters import head_drafter
    from mtp_train.runtime.speculative import SpeculativeDecoder
    from mtp_train.train.checkpoint import load_trained_head

    torch.manual_seed(recipe.seed)
    # Every prompt in one batch (up to 256), as vLLM schedules them, with vLLM's 2 GiB of KV here: admitting a
    # request mid-run makes a plain step in which no sequence drafts, and so does recomputing a preempted one, so a
    # narrower batch would verify fewer drafts than vLLM does for the same outputs.
    engine = Engine.from_pretrained(recipe.target.path, dtype=torch.float32, device="cpu", kv_bytes=KV_BYTES)
    prompts, token_ids, _, _ = eval_prompts(recipe, engine)
    # Every prompt prefilled in one step: while a prefill runs in chunks this runtime's steps are plain (no sequence
    # drafts), where vLLM drafts for the sequences already decoding, so long prompts would draft less here.
    engine.max_batch_tokens = max(engine.max_batch_tokens, sum(map(len, token_ids)))
    drafter = head_drafter(engine, load_trained_head(head, recipe.target.path, engine.cfg))
    params = SamplingParams(temperature=0.0, max_new_tokens=recipe.eval.max_new_tokens)
    plain = [r.tokens for r in engine.generate(token_ids, params)]
    runs = {}
    for k in ks:
        results = SpeculativeDecoder(engine, drafter, k).generate(token_ids, params)
        traces = request_traces(prompts, token_ids, results)
        runs[k] = {"tokens": [r.tokens for r in results], "tau": pooled_tau(traces),
                   "counts": engine_counts(traces, k)}
    return prompts, token_ids, plain, runs


def imported_source(head: Path) -> tuple[Path, str]:
    """The directory ``mtp-train import`` read the head at ``head`` from, and the head's kind."""
    config = head / "config.json"
    if not config.is_file():
        raise UserError(f"--head: {head} holds no head; `mtp-train import RECIPE SRC_DIR --name NAME` writes one")
    record = json.loads(config.read_text()).get("imported")
    if not record:
        raise UserError(f"--head: {head} was not written by `mtp-train import`; check a trained head by its "
                        "head.kind instead")
    source = Path(record["source"])
    if not (source / "config.json").is_file():
        raise UserError(f"--head: {source}, the file {head.name} was imported from, is gone; vLLM serves the head "
                        "as its trainer wrote it, so import it again from where it is now")
    return source, record["kind"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE recipe overrides")
    parser.add_argument("--k", type=int, nargs="+", help="draft lengths (default: the recipe's eval.k)")
    parser.add_argument("--format", choices=("vllm", "speculators"), default="vllm",
                        help="the export format vLLM loads (speculators: eagle3 heads)")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--head", metavar="imported/NAME", help="a head `mtp-train import` wrote: vLLM serves the "
                        "file it was imported from, this runtime the imported head (instead of head.kind's)")
    parser.add_argument("--work", type=Path, help="keep vLLM's jobs, outputs and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    try:
        return check(args)
    except UserError as e:
        print(f"vllm_check: {e}", file=sys.stderr)
        return 2


def check(args: argparse.Namespace) -> int:
    from mtp_train.eval.render import write_report
    from mtp_train.eval.report import load_report
    from mtp_train.export import export_head
    from mtp_train.recipe import load_recipe

    if not args.vllm_python.is_file():
        raise UserError(f"{args.vllm_python}: no vLLM environment; create it with `make vllm`")
    recipe = load_recipe(args.recipe, args.overrides)
    if not args.head and recipe.head.kind not in ("eagle", "eagle3", "dflash"):
        raise UserError(f"head.kind: {recipe.head.kind!r}; vLLM serves eagle, eagle3 and dflash heads of this "
                        "target: add head.kind=eagle, eagle3 or dflash")
    if args.format == "speculators" and args.head:
        raise UserError("--format: vLLM serves an imported head as its file was written; leave --format out")
    if args.format == "speculators" and recipe.head.kind != "eagle3":
        raise UserError("--format speculators: holds eagle3 heads; add head.kind=eagle3")
    ks = args.k or recipe.eval.k
    version = vllm_version(args.vllm_python)
    head = recipe.draft_dir(args.head) if args.head else recipe.head_dir()
    if args.head:  # vLLM reads the file the peer wrote; this runtime, the head mtp-train import made of it
        exported, method = imported_source(head)
    else:
        exported = export_head(recipe, args.format)
        method = recipe.head.kind
    written = json.loads((exported / "config.json").read_text())
    t0 = time.perf_counter()
    prompts, token_ids, plain, ours = runtime_runs(recipe, ks, head)
    print(f"vllm_check: this runtime: plain + k={ks} on {len(prompts)} prompts in {time.perf_counter() - t0:.0f}s",
          file=sys.stderr)
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm_check-"))
    work.mkdir(parents=True, exist_ok=True)
    e = recipe.eval
    job = {"target": str(recipe.target.path), "prompts": token_ids, "max_tokens": e.max_new_tokens,
           "max_model_len": max(len(t) for t in token_ids) + e.max_new_tokens + max(ks) + 8}
    t0 = time.perf_counter()
    theirs_plain = serve(args.vllm_python, {**job, "head": None}, work, "plain")["tokens"]
    # a P-EAGLE head: vLLM drafts it in parallel
    parallel = written.get("parallel_drafting", False) or written.get("speculators_model_type") == "peagle"
    theirs = {k: serve(args.vllm_python, {**job, "head": str(exported), "k": k, "method": method, "parallel": parallel},
                       work, f"k{k}") for k in ks}
    print(f"vllm_check: vLLM {version}: plain + k={ks} in {time.perf_counter() - t0:.0f}s (work dir {work})",
          file=sys.stderr)

    date = time.strftime("%Y-%m-%d")
    engine = f"vLLM {version} (CPU)" + (", speculators format" if args.format == "speculators" else
                                        f", {args.head}'s own file" if args.head else "")
    checks = []
    same_plain = sum(a == b for a, b in zip(plain, theirs_plain))
    print(f"\nvLLM {version} (CPU, float32) against this runtime, {recipe.target.path.name}, the {method} "
          f"head {'imported from' if args.head else 'exported to'} {exported}; {len(prompts)} prompts "
          f"({', '.join(e.prompt_sets)}), T = 0, at most {e.max_new_tokens} new tokens. vLLM's plain output equals "
          f"this runtime's plain output on {same_plain}/{len(prompts)} prompts.\n")
    print("| k | (a) vLLM spec = vLLM plain | (b) vLLM MAL | runtime MAL | difference | (c) vLLM accepted per position "
          "(of drafts) | runtime accepted per position (of drafts) | largest per-position difference | runtime τ | "
          "pass |\n|---:|---|---:|---:|---:|---|---|---:|---:|---|")
    for k in ks:
        identical = sum(a == b for a, b in zip(theirs[k]["tokens"], theirs_plain))
        c = build_check(engine, date, k, len(prompts), e.max_new_tokens, identical == len(prompts),
                        EngineCounts(**theirs[k]["counts"]), ours[k]["counts"])
        checks.append(c)
        ok = c.within_tolerance and c.identical_to_plain
        print(f"| {k} | {identical}/{len(prompts)} | {c.engine_mean_acceptance_length:.3f} | "
              f"{c.runtime_mean_acceptance_length:.3f} | {100 * c.relative_difference:+.2f}% | "
              f"{' / '.join(map(str, c.engine_accepted_per_position))} (of {c.engine_drafts}) | "
              f"{' / '.join(map(str, c.runtime_accepted_per_position))} (of {c.runtime_drafts}) | "
              f"{100 * c.max_position_difference:.2f}% | {ours[k]['tau']:.3f} | {'yes' if ok else 'NO'} |")
    failed = [c for c in checks if not (c.within_tolerance and c.identical_to_plain)]
    print(f"\n{'PASS' if not failed else 'FAIL'}: {len(checks) - len(failed)}/{len(checks)} k within "
          f"{100 * TOLERANCE:g}% with vLLM's speculative output identical to its plain output.")

    report_path = recipe.eval_dir / "report.json"
    if report_path.is_file():
        report = load_report(report_path)
        if report.mode == recipe.head.kind and not args.head:
            report.engine_checks = [c for c in report.engine_checks if c.engine != engine or c.k not in ks] + checks
            write_report(report, report_path.parent)
            print(f"vllm_check: added to {report_path.parent / 'report.html'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
