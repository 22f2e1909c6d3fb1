"""SpecForge side by side with this trainer at equal data: EAGLE-3 heads for SmolLM2, served by vLLM's CPU build.

    make smollm2 vllm peers         # once: the target, vLLM (.venv-vllm) and SpecForge (.venv-peers)
    .venv/bin/python bench/peer_parity.py [--rows 80] [--steps 30] [--scales 1 4] [--data sgd dolly] [--seeds 0 1 2]

For each data set, scale (``--rows`` × scale conversations, ``--steps`` × scale steps) and training seed:

1. **The conversations.** ``dolly``: the recipe's data (recipes/smollm2.yaml), Dolly prompts answered by SmolLM2
   itself (greedy, at most 96 tokens; regenerated once, ``--regen-rows`` rows; each cell takes its first rows).
   ``sgd``: SGD's training dialogues as written. Written to ``WORK/CELL/conversations.jsonl``.
2. **This trainer.** recipes/smollm2.yaml with ``head.kind=eagle3`` on those conversations: precompute, train,
   ``export --format vllm``. Its tokens/s is Σ tokens / Σ step_s of the train log (the optimizer steps only).
3. **SpecForge** (bench/peers/specforge_run.py in .venv-peers) on exactly the token ids and loss masks our
   precompute stored, the same max length and seed, for as many optimizer steps as ours took, each of as many rows
   as carry our mean tokens per step, one loader thread on both sides. Its lr, TTT length, warm-up and draft
   vocabulary are the row's (``--settings``): ``defaults``, each trainer at its own (SpecForge's: lr 1e-4, TTT 7,
   warm-up ratio 0.015, a 32k draft vocabulary of its own); ``matched``, SpecForge at ours (our draft vocabulary);
   ``tuned``, each at its own defaults but the lr and TTT length bench/peer_sweep.py found best for it.
4. **Scoring.** Both exported heads are served by vLLM (bench/vllm_serve.py, in .venv-vllm) on the same prompts:
   the held-out set of the data (Dolly rows no scale trains on; SGD's dev split), Spec-Bench and MT-bench first
   turns (``--prompts`` each, category-stratified), greedy, ``--new-tokens`` tokens, at k = 1..4. Lossless: every
   speculative output equals vLLM's plain output.

Everything lands in ``--work`` (default runs/peers). A rerun starts from scratch: regeneration, both trainers and
every vLLM run. With ``--reuse`` it keeps a run whose key still matches: the sha256 of its conversations, both
sides' settings, the seed, the target's weights and the code of this benchmark and of mtp_train (``key.json`` in
the run's directory); vLLM's results are keyed by the served head's sha256. Prints two Markdown tables (acceptance
per run; tokens/s and bytes per token), the goals at k = 3 pooled over cells and seeds, and the differences between
the two trainers that cannot be removed; ``WORK/peer_parity.json`` holds the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench.machine import machine_line  # noqa: E402

import yaml  # noqa: E402

from mtp_train.recipe import apply_overrides  # noqa: E402

from peer_table import ACCEPTANCE_HEADER, acceptance_rows, cost_rows, goal_rows  # noqa: E402
from vllm_check import serve  # noqa: E402

PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
RECIPE = REPO / "recipes" / "smollm2.yaml"
SGD = REPO / "data" / "sgd" / "sgd_train_sharegpt.jsonl.gz"
DOLLY = REPO / "data" / "general" / "prompts.jsonl.gz"
MTP_TRAIN = [sys.executable, "-m", "mtp_train.cli"]
CODE = ["mtp_train", "precompute", "eval", "bench/peers", "bench/peer_parity.py", "bench/peer_table.py",
        "bench/vllm_serve.py", "bench/vllm_check.py"]  # what a run's results depend on, besides data, settings, target
WORKERS = 1  # loader threads, both sides: ours prefetches its batches on one thread
# SpecForge 0.2.0's own defaults (its config schema and every EAGLE-3 example; gradient clipping 0.5, AdamW betas
# (0.9, 0.999) and the cosine to 0 are fixed in its code): lr, TTT length, warm-up ratio and a 32k draft vocabulary
# of its own, from the trained ids.
SPECFORGE = {"lr": 1e-4, "ttt_length": 7, "warmup_ratio": 0.015, "vocab": None, "draft_vocab": 32000,
             "workers": WORKERS}
DIFFERENCES = [
    "loss mask: SpecForge gates the prediction of t+2 on the mask at t (ours: on the mask of the predicted token; "
    "`train.mask_gate: input` trains ours as SpecForge does, bench/peer_ablation.py measures it)",
    "loss normalisation: SpecForge divides by batch × length, padding included (ours: a mean over masked tokens)",
    "teacher: SpecForge full-vocabulary logits restricted to the draft ids, skipping positions whose target top-1 "
    "is outside them (ours: the stored top-32 + tail, mapped to the draft vocabulary)",
    "features: ours bf16 hidden states of 3 layers + the last, top-32 logits; SpecForge's own capture format",
    "batches: ours packed windows of train.batch_tokens; SpecForge rows padded per batch",
    "gradient clipping: SpecForge 0.5 (ours: train.grad_clip 1.0)",
    "AdamW: SpecForge betas (0.9, 0.999) (ours (0.9, 0.95)); weight decay 0 in both",
    "schedule: SpecForge linear warm-up, then cosine to 0 (ours: cosine to 10% of lr)",
    "initialisation: ours starts the draft lm_head from the target's rows of the draft ids; SpecForge's is "
    "nn.Linear's default",
]


def conversations(data: str, rows: int, work: Path, regen_rows: int) -> list[dict]:
    """The first ``rows`` conversations of ``data`` in the openai format."""
    from mtp_train.data.dataset import load_rows

    if data == "sgd":
        return [{"messages": r.content} for r in load_rows([SGD], "sharegpt", False, rows).rows]
    regen = work / "regen"
    run([*MTP_TRAIN, "precompute", str(RECIPE), f"output_dir={regen}", f"data.max_rows={regen_rows}",
         "data.heldout_rows=0"], work / "regen.log")
    lines = (regen / "features" / "regenerated.rank-00000.jsonl").read_text().splitlines()[1:]
    by_id = {r["row_id"]: r["messages"] for r in map(json.loads, lines)}
    return [{"messages": by_id[i]} for i in sorted(by_id)[:rows]]


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """``cmd`` with its output appended to ``log``; a failure stops the benchmark naming the log."""
    with open(log, "a") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"peer_parity: {' '.join(map(str, cmd[:4]))} ... failed (exit {proc.returncode}); see {log}")


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def code_digest(paths: list[str] = CODE) -> str:
    """One sha256 over every file under ``paths`` (relative to the repository; caches left out), names included."""
    digest = hashlib.sha256()
    for top in paths:
        files = [REPO / top] if (REPO / top).is_file() else sorted((REPO / top).rglob("*"))
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts:
                digest.update(f"{f.relative_to(REPO)}\0{sha256_of(f)}\0".encode())
    return digest.hexdigest()


def dir_digest(directory: Path) -> str:
    """One sha256 over a directory's files, names included (a target's config, tokenizer and weights; a head)."""
    return hashlib.sha256("".join(f"{f.name}:{sha256_of(f)};" for f in sorted(directory.iterdir())
                                  if f.is_file()).encode()).hexdigest()


def fresh(directory: Path, key: dict, reuse: bool) -> bool:
    """Make ``directory`` the place of a run whose results depend on ``key``: kept as it is when ``reuse`` is asked
    and its ``key.json`` equals ``key``, else emptied and given ``key.json``. True when it was emptied."""
    stored = directory / "key.json"
    if reuse and stored.is_file() and json.loads(stored.read_text()) == json.loads(json.dumps(key)):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "key.tmp").write_text(json.dumps(key, indent=1))
    os.replace(directory / "key.tmp", stored)
    return True


def base_recipe() -> dict:
    """recipes/smollm2.yaml as a dict, its target path made absolute and its warm-up the one the table ran with."""
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["target"]["path"] = str((RECIPE.parent / recipe["target"]["path"]).resolve())
    recipe["train"]["warmup_steps"] = 10  # the table's runs (the recipe's one-hour run warms up over 20 since)
    return recipe


def settings_rows(recipe: dict, work: Path) -> dict[str, tuple[list[str], dict]]:
    """The comparison's rows: per name, our recipe's overrides and SpecForge's settings. ``defaults``: each trainer
    at its own; ``matched``: SpecForge at our lr, TTT length, warm-up and draft vocabulary; ``tuned`` (once
    bench/peer_sweep.py wrote ``WORK/tuned.json``): each at its own defaults but the lr and TTT length it did best
    with."""
    t = recipe["train"]
    rows = {"defaults": ([], SPECFORGE),
            "matched": ([], {"lr": t["lr"], "ttt_length": t["unroll"], "warmup_steps": t["warmup_steps"],
                             "vocab": "ours", "workers": WORKERS})}
    if (work / "tuned.json").is_file():
        best = json.loads((work / "tuned.json").read_text())
        ours, theirs = best["ours"], best["specforge"]
        rows["tuned"] = ([f"train.lr={ours['lr']}", f"train.unroll={ours['ttt']}"],
                         {**SPECFORGE, "lr": theirs["lr"], "ttt_length": theirs["ttt"]})
    return rows


def ours_name(overrides: list[str]) -> str:
    """Our run's directory in a cell: ``ours`` for the recipe as it is, else named by its overrides' hash."""
    return "ours-" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:8] if overrides else "ours"


def our_recipe(cell: Path, steps: int, overrides: list[str] | None = None, seed: int | None = None,
               name: str = "ours") -> Path:
    """recipes/smollm2.yaml with an eagle3 head on the cell's conversations as written, no held-out rows, into
    ``CELL/NAME``; then ``overrides`` as the CLI takes them (``["train.mask_gate=input"]``); ``seed`` replaces the
    recipe's."""
    recipe = base_recipe()
    recipe["seed"] = recipe["seed"] if seed is None else seed
    recipe["output_dir"] = str(cell / name)
    recipe["data"].update(train=str(cell / "conversations.jsonl"), format="openai", max_rows=None, heldout_rows=0,
                          regenerate=False)
    recipe["head"]["kind"] = "eagle3"
    recipe["eval"]["compare"] = []  # train no baseline heads beside it
    recipe["train"].update(max_steps=steps, val_every=10**6, save_every=10**6, wandb_mode="disabled")
    recipe = apply_overrides(recipe, overrides or [])
    path = cell / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def train_ours(cell: Path, steps: int, overrides: list[str] | None = None, seed: int | None = None,
               name: str = "ours") -> dict:
    """Precompute, train and export our head into ``CELL/NAME`` and ``CELL/NAME-vllm``; its cost (steps, tokens,
    tokens/s, bytes per token)."""
    recipe, log, head = our_recipe(cell, steps, overrides, seed, name), cell / f"{name}.log", cell / f"{name}-vllm"
    for stage in ("precompute", "train"):
        run([*MTP_TRAIN, stage, str(recipe)], log)
    if not (head / "config.json").is_file():
        run([*MTP_TRAIN, "export", str(recipe), "--format", "vllm", "--out", str(head)], log)
    records = [json.loads(line) for line in (cell / name / "train_log.eagle3.jsonl").read_text().splitlines()]
    features = cell / name / "features"  # every file counts: shards, indexes, manifests
    stored = json.loads((features / "manifest.json").read_text())
    tokens = sum(r["tokens"] for r in records)
    return {"steps": len(records), "tokens_trained": tokens, "tokens_per_s": tokens / sum(r["step_s"] for r in records),
            "bytes_per_token": sum(f.stat().st_size for f in features.iterdir()) / stored["totals"]["tokens"]}


def peer_inputs(cell: Path, ours: str = "ours") -> tuple[Path, Path, float]:
    """Our stored token ids and loss masks (of our run ``CELL/OURS``) as SpecForge's JSONL input, our draft vocabulary
    as its mapping, and the mean conversation length."""
    from safetensors.torch import load_file, save_file

    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(cell / ours / "features")
    tokens, lengths = cell / "tokens.jsonl", []
    with open(tokens, "w") as f:
        for ref in reader.train:
            rows = reader.load(ref)
            lengths.append(len(rows["input_ids"]))
            f.write(json.dumps({k: rows[k].tolist() for k in ("input_ids", "loss_mask")}) + "\n")
    head = load_file(cell / f"{ours}-vllm" / "model.safetensors")
    vocab = cell / "vocab.safetensors"
    save_file({"d2t": head["d2t"], "t2d": head["t2d"]}, vocab)
    return tokens, vocab, sum(lengths) / len(lengths)


def train_specforge(cell: Path, ours: dict, recipe: dict, settings: dict, threads: int, seed: int,
                    name: str = "specforge", ours_name: str = "ours") -> dict:
    """SpecForge into ``CELL/NAME`` on the token ids and masks of our run ``CELL/OURS_NAME`` (``ours``: its cost), as
    many optimizer steps as ours took, each of as many rows as carry our mean tokens per step; ``settings``: its
    lr, TTT length, warm-up and vocabulary (``"vocab": "ours"``: our draft vocabulary; ``None``: SpecForge's own), as
    :data:`SPECFORGE` names them. Its result.json."""
    out = cell / name
    tokens, vocab, mean_len = peer_inputs(cell, ours_name)
    batch = max(1, round(ours["tokens_trained"] / (ours["steps"] * mean_len)))
    job = {"target": recipe["target"]["path"], "tokens": str(tokens), "max_length": recipe["data"]["max_length"],
           **settings, "vocab": str(vocab) if settings["vocab"] == "ours" else None,
           "total_steps": ours["steps"], "batch_size": batch, "seed": seed, "threads": threads, "out": str(out),
           "tokens_sha256": hashlib.sha256(tokens.read_bytes()).hexdigest()}  # the same paths may hold new rows
    done, asked = out / "result.json", cell / f"{name}-job.json"
    if not done.is_file() or json.loads(done.read_text())["job"] != job:
        asked.write_text(json.dumps(job, indent=1))
        run([str(PEERS_PYTHON), str(REPO / "bench" / "peers" / "specforge_run.py"), str(asked)], cell / f"{name}.log")
    return json.loads(done.read_text())


def prompt_sets(data: str, n: int, regen_rows: int) -> dict[str, list[list[int]]]:
    """The scoring prompts as token ids: the data's held-out set, Spec-Bench and MT-bench, ``n`` each."""
    from transformers import AutoTokenizer

    from mtp_train.data.dataset import load_rows
    from mtp_train.eval.prompts import load_prompt_set, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(REPO / ".cache" / "smollm2-135m-instruct")
    if data == "sgd":
        heldout = load_prompt_set("sgd_dev", max_prompts=n)
    else:  # Dolly rows after every row any scale trains on
        rows = [r for r in load_rows([DOLLY], "openai", False, regen_rows + 4 * n).rows if r.row_id >= regen_rows]
        heldout = load_prompt_set("heldout", heldout_rows=rows, max_prompts=n)
    sets = {"heldout": heldout, **{name: load_prompt_set(name, max_prompts=n) for name in ("spec_bench", "mt_bench")}}
    return {name: [render_prompt(tokenizer, p.messages) for p in prompts] for name, prompts in sets.items()}


def scoring_job(recipe: dict, sets: dict[str, list[list[int]]], new_tokens: int, max_k: int) -> dict:
    """What every vLLM run of a data set shares: the target, the prompts, the tokens and a context that fits."""
    longest = max(len(ids) for prompts in sets.values() for ids in prompts)
    return {"target": recipe["target"]["path"], "sets": sets, "max_tokens": new_tokens,
            "max_model_len": longest + new_tokens + max_k + 8}


def served(job: dict, work: Path, name: str) -> dict:
    """One vLLM run (bench/vllm_serve.py), kept in ``work`` for reruns of the same job (the head's content, k,
    prompts)."""
    done, asked = work / f"{name}.out.json", work / f"{name}.json"
    if done.is_file() and asked.is_file() and json.loads(asked.read_text()) == json.loads(json.dumps(job)):
        return json.loads(done.read_text())
    done.unlink(missing_ok=True)
    return serve(VLLM_PYTHON, job, work, name)


def score(cell: Path, job: dict, plain: dict, ks: list[int], heads: dict[str, Path]) -> dict:
    """``[trainer][k][set]`` = vLLM's counters with each exported head (``heads``: trainer -> its directory in
    ``cell``) and whether its outputs equal plain's."""
    out: dict = {}
    for trainer, head in heads.items():
        out[trainer] = {}
        label = str(head.relative_to(cell)).replace("/", "-")
        for k in ks:
            result = served({**job, "head": str(head), "head_sha256": dir_digest(head),
                             "k": k, "method": "eagle3"}, cell, f"vllm-{label}-k{k}")
            out[trainer][k] = {name: {"counts": r["counts"], "lossless": r["tokens"] == plain["sets"][name]["tokens"]}
                               for name, r in result["sets"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=80, help="conversations at scale 1")
    parser.add_argument("--steps", type=int, default=30, help="training steps at scale 1 (this trainer's)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--data", nargs="+", choices=("dolly", "sgd"), default=["sgd", "dolly"])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per scoring set")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="SpecForge's torch threads (ours: the recipe's)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--regen-rows", type=int, default=1280, help="Dolly rows regenerated once (at least rows × "
                        "the largest scale); the held-out prompts come after them")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds, both trainers")
    parser.add_argument("--settings", nargs="+", default=["defaults"], choices=("defaults", "matched", "tuned"),
                        help="rows: each trainer at its own defaults; SpecForge at our settings; each at its best "
                        "lr and TTT length (bench/peer_sweep.py)")
    parser.add_argument("--reuse", action="store_true", help="keep runs whose key matches (default: from scratch)")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    for python, make in ((VLLM_PYTHON, "vllm"), (PEERS_PYTHON, "peers")):
        if not python.is_file():
            sys.exit(f"peer_parity: {python} not found; run `make {make}` first")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    recipe = base_recipe()
    known = settings_rows(recipe, args.work)
    if "tuned" in args.settings and "tuned" not in known:
        sys.exit(f"peer_parity: --settings tuned reads {args.work / 'tuned.json'}; run bench/peer_sweep.py first")
    rows = {name: known[name] for name in args.settings}
    regen_rows = max(args.regen_rows, args.rows * max(args.scales))
    shared = {"recipe": recipe, "target": dir_digest(Path(recipe["target"]["path"])), "code": code_digest(),
              "regen_rows": regen_rows, "threads": args.threads}
    fresh(args.work / "regen", shared, args.reuse)
    cells: dict = {name: {} for name in rows}
    scores: dict = {name: {} for name in rows}
    for data in args.data:
        sets = prompt_sets(data, args.prompts, regen_rows)
        job = scoring_job(recipe, sets, args.new_tokens, max(args.k))
        plain_dir = args.work / f"plain-{data}"
        fresh(plain_dir, {**shared, "job": job}, args.reuse)
        plain = served({**job, "head": None}, plain_dir, "vllm-plain")
        for scale in args.scales:
            text = "".join(json.dumps(c) + "\n" for c in conversations(data, args.rows * scale, args.work, regen_rows))
            for seed in args.seeds:
                run_name = f"{data} × {scale}, seed {seed}"
                cell = args.work / f"{data}-{scale}x-s{seed}"
                key = {**shared, "conversations": hashlib.sha256(text.encode()).hexdigest(), "seed": seed,
                       "steps": args.steps * scale, "scoring": job, "k": args.k, "rows": rows}
                fresh(cell, key, args.reuse)
                (cell / "conversations.jsonl").write_text(text)
                ours_runs: dict[str, dict] = {}
                for setting, (overrides, theirs) in rows.items():
                    mine = ours_name(overrides)
                    if mine not in ours_runs:
                        ours_runs[mine] = train_ours(cell, args.steps * scale, overrides, seed, mine)
                    peer = f"specforge-{setting}"
                    cells[setting][run_name] = {"ours": ours_runs[mine], "specforge": train_specforge(
                        cell, ours_runs[mine], recipe, theirs, args.threads, seed, peer, mine)}
                    scores[setting][run_name] = score(cell, job, plain, args.k, {
                        "ours": cell / f"{mine}-vllm", "specforge": cell / peer / "vllm"})
                print(f"peer_parity: {run_name} done", flush=True)
    report(cells, scores, rows, args)
    return 0


def report(cells: dict, scores: dict, rows: dict, args: argparse.Namespace) -> None:
    """Per row of settings: the tables, the goals at k = 3 and the cost ratios; then the differences that remain;
    the numbers into WORK/peer_parity.json."""
    goal_k = 3 if 3 in args.k else max(args.k)
    for setting, (overrides, theirs) in rows.items():
        print(f"\n### {setting}: ours {' '.join(overrides) or 'as recipes/smollm2.yaml'}; SpecForge {theirs}\n")
        print(ACCEPTANCE_HEADER)
        for name, s in scores[setting].items():
            print("\n".join(acceptance_rows(name, s, args.k)))
        print()
        print("\n".join(cost_rows(cells[setting])))
        print(f"\nGoals at k = {goal_k}, pooled over cells and seeds (ahead: by more than 2 standard errors):")
        for line, said in goal_rows(scores[setting], goal_k):
            print(f"- {said}: {line}")
        for what, better_high in (("tokens_per_s", True), ("bytes_per_token", False)):
            ratios = [c["ours"][what] / c["specforge"][what] for c in cells[setting].values()]
            print(f"- {what}, ours ÷ SpecForge: {min(ratios):.2f}–{max(ratios):.2f} over {len(ratios)} runs "
                  f"({'higher' if better_high else 'lower'} is ours ahead)")
    print("\nDifferences between the two trainers that remain:")
    for line in DIFFERENCES + sorted({n for c in cells.values() for r in c.values() for n in r["specforge"].get(
            "notes", [])}):
        print(f"- {line}")
    (args.work / "peer_parity.json").write_text(json.dumps({"cells": cells, "scores": scores, "rows": rows, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}, indent=1))

if __name__ == "__main__":
    sys.exit(main())
