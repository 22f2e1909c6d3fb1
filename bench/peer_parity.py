"""The field's trainers side by side with this one at equal data: EAGLE-3 heads for SmolLM2 trained by us, SpecForge
0.2.0 and speculators 0.9.0, all served by vLLM's CPU build.

    make smollm2 vllm peers speculators    # once: the target, vLLM, SpecForge and speculators (own virtualenvs)
    .venv/bin/python bench/peer_parity.py [--rows 80] [--steps 30] [--scales 1 4] [--data sgd dolly] [--seeds 0 1 2]
                                          [--settings tuned defaults] [--peers specforge speculators] [--reuse]
                                          [--untuned-seeds 0] [--speculators-scales 1] [--ours-base "K=V;..."]

For each data set, scale (``--rows`` × scale conversations, ``--steps`` × scale steps) and training seed, a cell
(scale by scale; the tuned row at every seed, the other rows at ``--untuned-seeds``, speculators at
``--speculators-scales``: the CPU hours go to the goals' row):

1. **The conversations.** ``dolly``: the recipe's data (recipes/smollm2.yaml), Dolly prompts answered by SmolLM2
   itself (greedy, at most 96 tokens; regenerated once, rows × the largest scale; each cell takes its first rows).
   ``sgd``: SGD's training dialogues as written. Written to ``WORK/CELL/conversations.jsonl``.
2. **This trainer.** recipes/smollm2.yaml with ``head.kind=eagle3`` on those conversations: precompute, train,
   ``export --format vllm``. Beside it, ``ours-exact`` trains the same head with ``train.teacher: exact`` and no
   top-K stored: the full-vocabulary teacher computed in the step from the stored last state, as the peers do.
   Tokens/s is Σ tokens / Σ step_s of the train log (each optimizer step's wall time, waiting for its batch
   included, as the peers' step times are).
3. **Each peer** (bench/peer_runs.py, bench/peers/) on exactly the token ids and loss masks our precompute stored,
   the same max length and seed, as many optimizer steps as ours took, each carrying our mean tokens per step, one
   loader thread on every side. Its lr, TTT length, warm-up and draft vocabulary are the row's (``--settings``):
   ``defaults``, each trainer at its own (SpecForge: lr 1e-4, TTT 7, warm-up ratio 0.015, a 32k draft vocabulary of
   its own; speculators: Muon at lr 1e-3, 3 TTT steps, the full vocabulary); ``matched``, the peers at our lr, TTT
   length and draft vocabulary; ``tuned``, each at its own defaults but the lr and TTT length bench/peer_sweep.py
   found best for it (the sweep runs first, at this comparison's cell size and scoring), ours with ``--ours-base``'s
   overrides too.
4. **Scoring.** Every exported head is served by vLLM (bench/vllm_serve.py, in .venv-vllm) on the same prompts:
   the held-out set of the data (Dolly rows no scale trains on; SGD's dev split), Spec-Bench and MT-bench first
   turns (``--prompts`` each, category-stratified), greedy, ``--new-tokens`` tokens, at k = 3 (``--k``). Lossless:
   every speculative output equals vLLM's plain output.

Runs land in ``--work`` (default runs/peers). ``--results`` (default bench/peer_results, committed as they land)
keeps each trainer's run as it ends (its cost and vLLM's counters, ``units/CELL/RUN.json``), each cell's outcome,
the sweep's and the regenerated conversations: a session cut short loses only the run it was in. A rerun starts
from scratch: regeneration, the sweep, every trainer and every vLLM run. With ``--reuse`` it keeps what was made
under a key that still matches: the sha256 of the conversations, every side's settings, the seed, the target's
weights and the code that trains, exports and serves (bench/peer_runs.py's ``CODE``); a run or cell whose outcome
is in ``--results`` is not run again, on any machine (acceptance pools across machines; costs are set side by side
only within one). vLLM's results are keyed by the served head's sha256. Prints, per row of settings, the acceptance
per run, the costs, the goals at k = 3 pooled over cells and seeds; then the differences between the trainers that
cannot be removed and the cells' wall time; ``WORK/peer_parity.json`` holds the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench.machine import machine_line  # noqa: E402
from mtp_train.io import write_json_atomic  # noqa: E402

from peer_runs import (DOLLY, MTP_TRAIN, RECIPE, RESULTS, RUNNERS, SGD, SPECFORGE, SPECULATORS,  # noqa: E402
                       VLLM_PYTHON, base_recipe, code_digest, dir_digest, fresh, keep, kept, ours_name, overrides_arg,
                       peer_job, peer_key, run, train_ours, train_peer, unit, with_point)
from peer_table import report  # noqa: E402
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


def conversations(data: str, rows: int, regenerated: list[list[dict]] | None = None) -> list[dict]:
    """The first ``rows`` conversations of ``data`` in the openai format (``dolly``: from ``regenerated``)."""
    from mtp_train.data.dataset import load_rows

    if data == "sgd":
        return [{"messages": r.content} for r in load_rows([SGD], "sharegpt", False, rows).rows]
    assert regenerated is not None and len(regenerated) >= rows
    return [{"messages": messages} for messages in regenerated[:rows]]


def regenerate(work: Path, results: Path, key: dict, rows: int, reuse: bool) -> list[list[dict]]:
    """The recipe's first ``rows`` Dolly prompts answered by SmolLM2 itself, once, kept in ``RESULTS/dolly-regen.json``
    (greedy answers can differ between CPUs, so another machine reuses these rather than its own)."""
    stored = results / "dolly-regen.json"
    outcome = kept(stored, key, reuse)
    if outcome is None:
        regen = work / "regen"
        fresh(regen, key, reuse=False)
        run([*MTP_TRAIN, "precompute", str(RECIPE), f"output_dir={regen}", f"data.max_rows={rows}",
             "data.heldout_rows=0", "train.tau_every=0"], work / "regen.log")
        lines = (regen / "features" / "regenerated.rank-00000.jsonl").read_text().splitlines()[1:]
        by_id = {r["row_id"]: r["messages"] for r in map(json.loads, lines)}
        outcome = keep(stored, key, {"machine": machine_line(), "rows": [by_id[i] for i in sorted(by_id)]})
    return outcome["rows"]


def settings_rows(recipe: dict, results: Path) -> dict[str, tuple[list[str], dict[str, dict]]]:
    """The comparison's rows: per name, our recipe's overrides and each peer's settings. ``defaults``: each trainer
    at its own; ``matched``: the peers at our lr, TTT length and draft vocabulary (SpecForge at our warm-up too);
    ``tuned`` (once bench/peer_sweep.py wrote ``RESULTS/tuned.json``): each at its own defaults but the lr and TTT
    length it did best with (ours: only what differs from the recipe, so an unchanged run is shared)."""
    t = recipe["train"]
    matched = {peer: with_point(peer, {**settings, "vocab": "ours"}, t["lr"], t["unroll"])
               for peer, settings in PEERS.items()}
    matched["specforge"] = {**matched["specforge"], "warmup_steps": t["warmup_steps"]}
    matched["specforge"].pop("warmup_ratio")
    rows = {"defaults": ([], dict(PEERS)), "matched": ([], matched)}
    if (results / "tuned.json").is_file():
        best = json.loads((results / "tuned.json").read_text())
        ours = best.get("ours_base", []) + [f"train.{name}={best['ours'][field]}" for name, field in
                                            (("lr", "lr"), ("unroll", "ttt")) if best["ours"][field] != t[name]]
        rows["tuned"] = (ours, {
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


def score(cell: Path, job: dict, plain: dict, ks: list[int], head: Path) -> dict:
    """``[k][set]`` = vLLM's counters with the exported head (its directory in ``cell``) and whether its outputs
    equal plain's."""
    label, out = str(head.relative_to(cell)).replace("/", "-"), {}
    for k in ks:
        result = served({**job, "head": str(head), "head_sha256": dir_digest(head), "k": k, "method": "eagle3"},
                        cell, f"vllm-{label}-k{k}")
        out[k] = {name: {"counts": r["counts"], "lossless": r["tokens"] == plain["sets"][name]["tokens"]}
                  for name, r in result["sets"].items()}
    return out


EXACT = ["train.teacher=exact", "precompute.topk=0"]  # ours as the peers train: the full-vocabulary teacher


class Trainers:
    """The runs of one cell (or sweep point) at one seed: ours trained at most once per overrides in this process,
    and only when a run needs it (its own, or a peer's, which trains on our stored tokens). Each method returns the
    run's cost and its exported head, as bench/peer_runs.py's :func:`unit` takes them."""

    def __init__(self, cell: Path, steps: int, seed: int, recipe: dict, threads: int) -> None:
        self.cell, self.steps, self.seed, self.recipe, self.threads = cell, steps, seed, recipe, threads
        self.trained: dict[str, dict] = {}

    def ours(self, overrides: list[str]) -> tuple[dict, Path]:
        name = ours_name(overrides)
        if name not in self.trained:
            self.trained[name] = train_ours(self.cell, self.steps, overrides, self.seed, name)
        return self.trained[name], self.cell / f"{name}-vllm"

    def peer(self, trainer: str, overrides: list[str], settings: dict, job: dict) -> tuple[dict, Path]:
        """``trainer``'s run of ``job`` (bench/peer_runs.py's :func:`peer_job` of ``settings``) on the inputs of our
        run with ``overrides``, trained here when its outputs are not on disk; stopped if that run hands over other
        inputs than the job was made from (the kept cost's)."""
        cost, _ = self.ours(overrides)
        name = Path(job["out"]).name
        again = peer_job(trainer, self.cell, ours_name(overrides), cost, self.recipe, settings, self.threads,
                         self.seed, name)
        if again != job:
            sys.exit(f"peer_parity: our run {self.cell / ours_name(overrides)} hands {trainer} other inputs than its "
                     f"kept cost: {sorted(k for k in job if job[k] != again.get(k))}; rerun without --reuse")
        return train_peer(trainer, job, self.cell, name), self.cell / name / "vllm"

    def peer_unit(self, trainer: str, overrides: list[str], ours: dict, settings: dict, name: str, scoring: dict,
                  path: Path, reuse: bool, scored: Callable[[Path], dict]) -> dict:
        """``trainer`` (with ``settings``) on the inputs of our run with ``overrides`` (``ours``: its unit), kept at
        ``path`` under its content key (bench/peer_runs.py's :func:`peer_key`, with ``scoring``)."""
        job = peer_job(trainer, self.cell, ours_name(overrides), ours["cost"], self.recipe, settings, self.threads,
                       self.seed, name)
        return unit(path, peer_key(trainer, job, ours["cost"], scoring), reuse,
                    functools.partial(self.peer, trainer, overrides, settings, job), scored)


def run_cell(cell: Path, key: dict, rows: dict, steps: int, recipe: dict, threads: int, plain: Callable[[], dict],
             ks: list[int], units: Path, reuse: bool) -> dict:
    """Every row's trainers in one cell (a data set at one scale and seed; ``key``: the cell's, less its rows), each
    run trained and scored as a unit kept in ``units`` (bench/peer_runs.py's :func:`unit`): ``{"costs": {setting:
    {trainer: cost}}, "scores": {setting: {trainer: {k: {set: ...}}}}, "wall_s", "machine"}``, the wall time summed
    over the units and their machines. Beside ours (``ours``), ``ours-exact`` trains the same head with the exact
    teacher and no top-K stored, as the peers train."""
    trainers = Trainers(cell, steps, key["seed"], recipe, threads)

    def scored(head: Path) -> dict:
        return score(cell, key["scoring"], plain(), ks, head)

    out: dict = {"costs": {}, "scores": {}}
    made: dict[str, dict] = {}
    for setting, (overrides, theirs) in rows.items():
        runs = {}
        for trainer, variant in (("ours", overrides), ("ours-exact", overrides + EXACT)):
            path = units / f"{ours_name(variant)}.json"
            runs[trainer] = made[path.name] = unit(path, {**key, "trainer": "ours", "overrides": variant}, reuse,
                                                   functools.partial(trainers.ours, variant), scored)
        for name, settings in theirs.items():
            path = units / f"{name}-{setting}.json"
            runs[name] = made[path.name] = trainers.peer_unit(
                name, overrides, runs["ours"], settings, path.stem, {"job": key["scoring"], "k": ks}, path, reuse,
                scored)
        out["costs"][setting] = {t: u["cost"] for t, u in runs.items()}
        out["scores"][setting] = {t: u["scores"] for t, u in runs.items()}
    return {**out, "wall_s": round(sum(u["wall_s"] for u in made.values()), 1),
            "machine": sorted({u["machine"] for u in made.values()})}


def tuned_settings(args: argparse.Namespace) -> None:
    """bench/peer_sweep.py at this comparison's cell size and scoring, into ``RESULTS/tuned.json`` (kept with
    ``--reuse`` when its key still matches)."""
    import peer_sweep

    peer_sweep.main(["--rows", str(args.rows), "--steps", str(args.steps), "--prompts", str(args.prompts),
                     "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--work", str(args.work),
                     "--results", str(args.results), "--peers", *args.peers, "--lr", *map(str, args.sweep_lr),
                     "--ttt", *map(str, args.sweep_ttt), "--ours-base", ";".join(args.ours_base),
                     *(["--reuse"] if args.reuse else [])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=80, help="conversations at scale 1")
    parser.add_argument("--steps", type=int, default=30, help="training steps at scale 1 (this trainer's)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--data", nargs="+", choices=("dolly", "sgd"), default=["sgd", "dolly"])
    parser.add_argument("--k", type=int, nargs="+", default=[3], help="draft lengths scored (the goals' is 3)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per scoring set")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="the peers' torch threads (ours: the recipe's)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--results", type=Path, default=RESULTS, help="each cell's outcome, kept for --reuse on "
                        "any machine (default: bench/peer_results, committed)")
    parser.add_argument("--regen-rows", type=int, help="Dolly rows regenerated once (default and least: rows × the "
                        "largest scale); the held-out prompts come after them")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds, every trainer")
    parser.add_argument("--settings", nargs="+", default=["tuned", "defaults"],
                        choices=("defaults", "matched", "tuned"), help="rows: each trainer at its own defaults; the "
                        "peers at our settings; each at its best lr and TTT length (bench/peer_sweep.py runs first)")
    parser.add_argument("--sweep-lr", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2], help="the tuned "
                        "row's grid of learning rates (bench/peer_sweep.py)")
    parser.add_argument("--sweep-ttt", type=int, nargs="+", default=[2, 7], help="the tuned row's grid of TTT lengths")
    parser.add_argument("--ours-base", type=overrides_arg, default=[], help="our overrides at every point of the tuned "
                        "row's grid, joined by ';' (bench/peer_sweep.py's --ours-base)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--untuned-seeds", type=int, nargs="+", default=[0], help="the seeds at which the rows "
                        "other than tuned run (the goals read the tuned row, at every seed)")
    parser.add_argument("--speculators-scales", type=int, nargs="+", default=[1], help="the scales at which "
                        "speculators trains (its steps cost about 9 s each on 2 cores)")
    parser.add_argument("--reuse", action="store_true", help="keep runs whose key matches (default: from scratch)")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    for python, make in [(VLLM_PYTHON, "vllm")] + [RUNNERS[peer] for peer in args.peers]:
        if not python.is_file():
            sys.exit(f"peer_parity: {python} not found; run `make {make}` first")
    args.work, args.results = args.work.resolve(), args.results.resolve()
    with held(args.work, "peer_parity"):
        return compare(args)


@contextlib.contextmanager
def held(work: Path, script: str) -> Iterator[None]:
    """One run of ``script`` at a time in ``work`` (mtp_train's lock, released however the run ends but a kill,
    taken over after one): a second stops in one line naming the first."""
    from mtp_train.errors import UserError
    from mtp_train.lock import acquire, release

    work.mkdir(parents=True, exist_ok=True)
    lock = work / f"{script}.lock"
    try:
        record = acquire(lock, f"bench/{script}.py in {work}")
    except UserError as e:
        sys.exit(f"{script}: {e}")
    try:
        yield
    finally:
        release(lock, record)


def compare(args: argparse.Namespace) -> int:
    """The sweep (for the tuned row), the regeneration, every cell and the report."""
    if "tuned" in args.settings:
        tuned_settings(args)
    recipe = base_recipe()
    known = settings_rows(recipe, args.results)
    rows = {name: (known[name][0], {peer: known[name][1][peer] for peer in args.peers}) for name in args.settings}
    regen_rows = max(args.regen_rows or 0, args.rows * max(args.scales))
    shared = {"recipe": recipe, "target": dir_digest(Path(recipe["target"]["path"])), "code": code_digest(),
              "regen_rows": regen_rows, "threads": args.threads}
    regenerated = (regenerate(args.work, args.results, shared, regen_rows, args.reuse)
                   if "dolly" in args.data else None)  # only Dolly's conversations are regenerated
    outcomes: dict = {}
    jobs = {data: scoring_job(recipe, prompt_sets(data, args.prompts, regen_rows), args.new_tokens, max(args.k))
            for data in args.data}
    plains = {data: plain_run(args.work / f"plain-{data}", {**shared, "job": job}, args.reuse)
              for data, job in jobs.items()}
    for scale in args.scales:  # every data set and seed at the small scale first
        for data, job in jobs.items():
            text = "".join(json.dumps(c) + "\n" for c in conversations(data, args.rows * scale, regenerated))
            for seed in args.seeds:
                cell = args.work / f"{data}-{scale}x-s{seed}"
                key = {**shared, "conversations": hashlib.sha256(text.encode()).hexdigest(), "seed": seed,
                       "steps": args.steps * scale, "scoring": job, "k": args.k,
                       "rows": cell_rows(rows, scale, seed, args)}
                stored = args.results / f"{cell.name}.json"
                outcome = kept(stored, key, args.reuse)
                if outcome is None:
                    fresh(cell, key, args.reuse)
                    (cell / "conversations.jsonl").write_text(text)
                    outcome = run_cell(cell, {k: v for k, v in key.items() if k != "rows"}, key["rows"],
                                       args.steps * scale, recipe, args.threads, plains[data], args.k,
                                       args.results / "units" / cell.name, args.reuse)
                    outcome = keep(stored, key, {"run": f"{data} × {scale}, seed {seed}", **outcome})
                outcomes[cell.name] = outcome
                print(f"peer_parity: {outcome['run']} done ({outcome['wall_s']:.0f} s)", flush=True)
    report(outcomes, rows, args.k, DIFFERENCES)
    write_json_atomic(args.work / "peer_parity.json", {"cells": outcomes, "rows": rows, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    return 0


def cell_rows(rows: dict, scale: int, seed: int, args: argparse.Namespace) -> dict:
    """The rows a cell runs: tuned at every seed, the others at ``--untuned-seeds``; speculators at
    ``--speculators-scales`` only."""
    return {name: (overrides, {p: s for p, s in theirs.items() if p != "speculators" or scale in
                               args.speculators_scales})
            for name, (overrides, theirs) in rows.items() if name == "tuned" or seed in args.untuned_seeds}


def plain_run(directory: Path, key: dict, reuse: bool) -> Callable[[], dict]:
    """vLLM's plain run of a data set's prompts, made on first use (a cell kept from the results needs none)."""
    @functools.cache
    def get() -> dict:
        fresh(directory, key, reuse)
        return served({**key["job"], "head": None}, directory, "vllm-plain")
    return get

if __name__ == "__main__":
    sys.exit(main())
