"""The field's trainers side by side with this one at equal data: EAGLE-3 heads for SmolLM2 trained by us, SpecForge
0.2.0 and speculators 0.9.0, all served by vLLM's CPU build.

    make smollm2 vllm peers speculators    # once: the target, vLLM, SpecForge and speculators (own virtualenvs)
    .venv/bin/python bench/peer_parity.py [--rows 80] [--steps 30] [--scales 1 4] [--data sgd dolly] [--seeds 0 1 2]
                                          [--settings defaults tuned] [--peers specforge speculators] [--reuse]

For each data set, scale (``--rows`` × scale conversations, ``--steps`` × scale steps) and training seed:

1. **The conversations.** ``dolly``: the recipe's data (recipes/smollm2.yaml), Dolly prompts answered by SmolLM2
   itself (greedy, at most 96 tokens; regenerated once, ``--regen-rows`` rows; each cell takes its first rows).
   ``sgd``: SGD's training dialogues as written. Written to ``WORK/CELL/conversations.jsonl``.
2. **This trainer.** recipes/smollm2.yaml with ``head.kind=eagle3`` on those conversations: precompute, train,
   ``export --format vllm``. Its tokens/s is Σ tokens / Σ step_s of the train log (the optimizer steps only).
3. **Each peer** (bench/peer_runs.py, bench/peers/) on exactly the token ids and loss masks our precompute stored,
   the same max length and seed, as many optimizer steps as ours took, each carrying our mean tokens per step, one
   loader thread on every side. Its lr, TTT length, warm-up and draft vocabulary are the row's (``--settings``):
   ``defaults``, each trainer at its own (SpecForge: lr 1e-4, TTT 7, warm-up ratio 0.015, a 32k draft vocabulary of
   its own; speculators: Muon at lr 1e-3, 3 TTT steps, the full vocabulary); ``matched``, the peers at our lr, TTT
   length and draft vocabulary; ``tuned``, each at its own defaults but the lr and TTT length bench/peer_sweep.py
   found best for it.
4. **Scoring.** Every exported head is served by vLLM (bench/vllm_serve.py, in .venv-vllm) on the same prompts:
   the held-out set of the data (Dolly rows no scale trains on; SGD's dev split), Spec-Bench and MT-bench first
   turns (``--prompts`` each, category-stratified), greedy, ``--new-tokens`` tokens, at k = 1..4. Lossless: every
   speculative output equals vLLM's plain output.

Everything lands in ``--work`` (default runs/peers). A rerun starts from scratch: regeneration, every trainer and
every vLLM run. With ``--reuse`` it keeps a run whose key still matches: the sha256 of its conversations, every
side's settings, the seed, the target's weights and the code of this benchmark and of mtp_train (``key.json`` in
the run's directory); vLLM's results are keyed by the served head's sha256. Prints, per row of settings, the
acceptance per run, the costs, and the goals at k = 3 pooled over cells and seeds; then the differences between the
trainers that cannot be removed; ``WORK/peer_parity.json`` holds the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench.machine import machine_line  # noqa: E402

from peer_runs import (DOLLY, MTP_TRAIN, RECIPE, RUNNERS, SGD, SPECFORGE, SPECULATORS, VLLM_PYTHON,  # noqa: E402
                       base_recipe, code_digest, dir_digest, fresh, ours_name, run, train_ours, train_peer,
                       with_point)
from peer_table import acceptance_header, acceptance_rows, cost_rows, goal_rows  # noqa: E402
from vllm_check import serve  # noqa: E402

PEERS = {"specforge": SPECFORGE, "speculators": SPECULATORS}  # each peer's own defaults
DIFFERENCES = [
    "speculators: Muon (its default) or AdamW, linear warm-up and decay, equal TTT step weights, KL over its draft "
    "vocabulary without SpecForge's top-1 gate, its frozen lm_head copied from the target's rows; rows packed to "
    "one sequence per step (bench/peers/README.md)",
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


def settings_rows(recipe: dict, work: Path) -> dict[str, tuple[list[str], dict[str, dict]]]:
    """The comparison's rows: per name, our recipe's overrides and each peer's settings. ``defaults``: each trainer
    at its own; ``matched``: the peers at our lr, TTT length and draft vocabulary (SpecForge at our warm-up too);
    ``tuned`` (once bench/peer_sweep.py wrote ``WORK/tuned.json``): each at its own defaults but the lr and TTT
    length it did best with."""
    t = recipe["train"]
    matched = {peer: with_point(peer, {**settings, "vocab": "ours"}, t["lr"], t["unroll"])
               for peer, settings in PEERS.items()}
    matched["specforge"] = {**matched["specforge"], "warmup_steps": t["warmup_steps"]}
    matched["specforge"].pop("warmup_ratio")
    rows = {"defaults": ([], dict(PEERS)), "matched": ([], matched)}
    if (work / "tuned.json").is_file():
        best = json.loads((work / "tuned.json").read_text())
        rows["tuned"] = ([f"train.lr={best['ours']['lr']}", f"train.unroll={best['ours']['ttt']}"], {
            peer: with_point(peer, settings, best[peer]["lr"], best[peer]["ttt"])
            for peer, settings in PEERS.items() if peer in best})
    return rows


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
    parser.add_argument("--threads", type=int, default=2, help="the peers' torch threads (ours: the recipe's)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--regen-rows", type=int, default=1280, help="Dolly rows regenerated once (at least rows × "
                        "the largest scale); the held-out prompts come after them")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds, every trainer")
    parser.add_argument("--settings", nargs="+", default=["defaults"], choices=("defaults", "matched", "tuned"),
                        help="rows: each trainer at its own defaults; the peers at our settings; each at its best "
                        "lr and TTT length (bench/peer_sweep.py)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--reuse", action="store_true", help="keep runs whose key matches (default: from scratch)")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    for python, make in [(VLLM_PYTHON, "vllm")] + [RUNNERS[peer] for peer in args.peers]:
        if not python.is_file():
            sys.exit(f"peer_parity: {python} not found; run `make {make}` first")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    recipe = base_recipe()
    known = settings_rows(recipe, args.work)
    if "tuned" in args.settings and "tuned" not in known:
        sys.exit(f"peer_parity: --settings tuned reads {args.work / 'tuned.json'}; run bench/peer_sweep.py first")
    rows = {name: (known[name][0], {peer: known[name][1][peer] for peer in args.peers}) for name in args.settings}
    regen_rows = max(args.regen_rows, args.rows * max(args.scales))
    shared = {"recipe": recipe, "target": dir_digest(Path(recipe["target"]["path"])), "code": code_digest(),
              "regen_rows": regen_rows, "threads": args.threads}
    if "dolly" in args.data:  # only Dolly's conversations are regenerated
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
                    cells[setting][run_name] = {"ours": ours_runs[mine], **{peer: train_peer(
                        peer, cell, ours_runs[mine], recipe, settings, args.threads, seed, f"{peer}-{setting}", mine)
                        for peer, settings in theirs.items()}}
                    heads = {"ours": cell / f"{mine}-vllm", **{p: cell / f"{p}-{setting}" / "vllm" for p in theirs}}
                    scores[setting][run_name] = score(cell, job, plain, args.k, heads)
                print(f"peer_parity: {run_name} done", flush=True)
    report(cells, scores, rows, args)
    return 0


def report(cells: dict, scores: dict, rows: dict, args: argparse.Namespace) -> None:
    """Per row of settings: the tables, the goals at k = 3 and the cost ratios against each peer; then the
    differences that remain; the numbers into WORK/peer_parity.json."""
    goal_k = 3 if 3 in args.k else max(args.k)
    for setting, (overrides, theirs) in rows.items():
        print(f"\n### {setting}: ours {' '.join(overrides) or 'as recipes/smollm2.yaml'}; {theirs}\n")
        print(acceptance_header(list(theirs)))
        for name, s in scores[setting].items():
            print("\n".join(acceptance_rows(name, s, args.k)))
        print()
        print("\n".join(cost_rows(cells[setting])))
        print(f"\nGoals at k = {goal_k}, pooled over cells and seeds (ahead: by more than 2 standard errors):")
        for peer in theirs:
            for line, said in goal_rows(scores[setting], goal_k, peer):
                print(f"- {said}: {line}")
            for what, better_high in (("tokens_per_s", True), ("bytes_per_token", False)):
                ratios = [c["ours"][what] / c[peer][what] for c in cells[setting].values()]
                print(f"- {what}, ours ÷ {peer}: {min(ratios):.2f}–{max(ratios):.2f} over {len(ratios)} runs "
                      f"({'higher' if better_high else 'lower'} is ours ahead)")
    print("\nDifferences between the trainers that remain:")
    notes = {n for c in cells.values() for r in c.values() for t, v in r.items() if t != "ours" for n in v["notes"]}
    for line in DIFFERENCES + sorted(notes):
        print(f"- {line}")
    (args.work / "peer_parity.json").write_text(json.dumps({"cells": cells, "scores": scores, "rows": rows, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
