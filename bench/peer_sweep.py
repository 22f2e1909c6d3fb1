"""Each trainer at its best for bench/peer_parity.py's ``tuned`` row: learning rate × TTT length, the same grid for
every trainer, trained on one cell (SGD as written, scale 1, seed 0) and chosen by vLLM's mean acceptance length at
k = 3 on a validation split, SGD training dialogues that no cell trains on.

    make smollm2 vllm peers speculators
    .venv/bin/python bench/peer_sweep.py [--lr 3e-4 1e-3 3e-3 1e-2] [--ttt 2 7] [--ours-base "K=V;..."] [--reuse]
                                         [--kept]
    .venv/bin/python bench/peer_parity.py --settings tuned defaults

At each grid point: ours is recipes/smollm2.yaml with ``--ours-base``'s overrides, ``train.lr`` and ``train.unroll``
set; each peer is at its own defaults (SpecForge: its warm-up ratio and 32k draft vocabulary; speculators: Muon,
the full vocabulary) with that lr and TTT length, at our number of optimizer steps and tokens per step, as in
peer_parity. The validation prompts are the first user turns of SGD training dialogues from row ``--rows`` × 4 on
(peer_parity's largest cell trains on rows below that), ``--prompts`` of them. Writes ``RESULTS/tuned.json`` (each
trainer's best point, the whole grid and its key's digest; RESULTS is bench/peer_results, committed) and prints the
grid. Like peer_parity: from scratch unless ``--reuse``, which keeps tuned.json when its key still matches, and each
trainer's run at each point (``RESULTS/sweep``) when its key does: a session cut short loses only the run it was in.
``--kept`` prints the grid as far as ``RESULTS/sweep`` holds it under the current key and trains nothing.
bench/peer_parity.py with ``--settings tuned`` runs this first, at its own cell size and scoring.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

import peer_parity as pp  # noqa: E402
import peer_runs as pr  # noqa: E402
from peer_table import pooled  # noqa: E402

K = 3


def validation_prompts(first_row: int, n: int) -> dict[str, list[list[int]]]:
    """``{"validation": token ids}``: the first user turns of SGD training dialogues from ``first_row`` on."""
    from transformers import AutoTokenizer

    from mtp_train.data.dataset import load_rows
    from mtp_train.eval.prompts import load_prompt_set, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(REPO / ".cache" / "smollm2-135m-instruct")
    rows = [r for r in load_rows([pr.SGD], "sharegpt", False, first_row + 4 * n).rows if r.row_id >= first_row]
    prompts = load_prompt_set("heldout", heldout_rows=rows, max_prompts=n)
    return {"validation": [render_prompt(tokenizer, p.messages) for p in prompts]}


def point_runs(key: dict, lr: float, ttt: int, peers: list[str], results: Path
               ) -> tuple[tuple[Path, dict], dict[str, tuple[Path, dict]]]:
    """At one grid point, where each trainer's run is kept (``RESULTS/sweep``): ours with the key it is kept under
    (``key``: the sweep's, less its grid, with our overrides: ``--ours-base``, the lr and TTT length), and per peer its
    settings (a peer's key is its content: bench/peer_runs.py's :func:`peer_key`)."""
    units = results / "sweep"
    overrides = [*key["ours_base"], f"train.lr={lr}", f"train.unroll={ttt}"]
    ours = (units / f"{pr.ours_name(key['ours_base'])}-lr{lr:g}-ttt{ttt}.json",
            {**key, "trainer": "ours", "overrides": overrides})
    return ours, {name: (units / f"{name}-lr{lr:g}-ttt{ttt}.json", pr.with_point(name, pp.PEERS[name], lr, ttt))
                  for name in peers}


def grid_point(cell: Path, key: dict, recipe: dict, lr: float, ttt: int, args: argparse.Namespace, job: dict,
               plain: Callable[[], dict]) -> dict[str, dict]:
    """Every trainer at one point of the grid (seed 0), each run a unit kept in ``RESULTS/sweep`` (bench/peer_runs.py's
    :func:`unit`; ``key``: the sweep's, less its grid): per trainer its cost and vLLM results at k = 3."""
    (path, ours_key), peers = point_runs(key, lr, ttt, args.peers, args.results)
    trainers = pp.Trainers(cell, args.steps, 0, recipe, args.threads)

    def scored(head: Path) -> dict:
        return pp.score(cell, job, plain(), [K], head)

    out = {"ours": pr.unit(path, ours_key, args.reuse, functools.partial(trainers.ours, ours_key["overrides"]),
                           scored)}
    for name, (peer_path, settings) in peers.items():
        out[name] = trainers.peer_unit(name, ours_key["overrides"], out["ours"], settings, peer_path.stem,
                                       {"job": job, "k": [K]}, peer_path, args.reuse, scored)
    return out


def print_kept(key: dict, args: argparse.Namespace) -> None:
    """The grid as far as ``RESULTS/sweep`` holds it under this key (``--kept``: nothing is trained): MAL at k = 3
    per trainer, "–" for a run not made yet."""
    trainers = ["ours", *args.peers]
    print("\n| lr | TTT | " + " | ".join(trainers) + " | lossless |")
    print("|---:|---:|" + "---:|" * len(trainers) + "---|")
    for lr in args.lr:
        for ttt in args.ttt:
            (path, ours_key), peers = point_runs(key, lr, ttt, args.peers, args.results)
            kept = {"ours": pr.kept(path, ours_key, True)}
            if kept["ours"]:  # a peer's key holds the inputs our run at this point handed it
                cell = args.work.resolve() / "sweep-sgd-1x-s0"
                for name, (peer_path, settings) in peers.items():
                    peer_job = pr.peer_job(name, cell, pr.ours_name(ours_key["overrides"]), kept["ours"]["cost"],
                                           key["recipe"], settings, args.threads, 0, peer_path.stem)
                    kept[name] = pr.kept(peer_path, pr.peer_key(name, peer_job, kept["ours"]["cost"],
                                                                {"job": key["scoring"], "k": [K]}), True)
            sets = {name: list(o["scores"][str(K)].values()) for name, o in kept.items() if o}
            mal = {name: pooled([r["counts"] for r in v]).mal for name, v in sets.items()}
            lossless = all(r["lossless"] for v in sets.values() for r in v)
            print(f"| {lr:g} | {ttt} | " + " | ".join(f"{mal[t]:.3f}" if t in mal else "–" for t in trainers)
                  + f" | {('yes' if lossless else 'NO') if sets else '–'} |")


def best(grid: list[dict], trainer: str) -> dict:
    """The grid point with the highest MAL of ``trainer`` (the earlier point on a tie)."""
    point = max(grid, key=lambda g: g[trainer]["mal"])
    return {"lr": point["lr"], "ttt": point["ttt"], "mal": point[trainer]["mal"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    parser.add_argument("--ttt", type=int, nargs="+", default=[2, 7])
    parser.add_argument("--rows", type=int, default=80, help="conversations trained on (peer_parity's scale 1)")
    parser.add_argument("--steps", type=int, default=30, help="our optimizer steps (peer_parity's scale 1)")
    parser.add_argument("--prompts", type=int, default=16, help="validation prompts")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--results", type=Path, default=pr.RESULTS, help="where tuned.json goes (committed)")
    parser.add_argument("--peers", nargs="+", default=list(pp.PEERS), choices=list(pp.PEERS))
    parser.add_argument("--ours-base", type=pr.overrides_arg, default=[], help="our recipe overrides at every grid "
                        "point, joined by ';' (the options our trainer is tuned at beside the grid; default: the "
                        "recipe's)")
    parser.add_argument("--reuse", action="store_true", help="keep runs whose key matches (default: from scratch)")
    parser.add_argument("--kept", action="store_true", help="print the grid as far as RESULTS/sweep holds it; train "
                        "nothing")
    args = parser.parse_args(argv)
    args.results = args.results.resolve()
    print(machine_line(), flush=True)
    for python, make in [(pr.VLLM_PYTHON, "vllm")] + [pr.RUNNERS[peer] for peer in args.peers]:
        if not python.is_file():
            sys.exit(f"peer_sweep: {python} not found; run `make {make}` first")
    if args.kept:
        return sweep(args)
    with pp.held(args.work.resolve(), "peer_sweep"):
        return sweep(args)


def sweep(args: argparse.Namespace) -> int:
    """The grid trained and scored (or kept), ``tuned.json`` written, the grid printed."""
    work = args.work.resolve()
    recipe = pr.base_recipe()
    sets = validation_prompts(args.rows * 4, args.prompts)
    job = pp.scoring_job(recipe, sets, args.new_tokens, K)
    text = "".join(json.dumps(c) + "\n" for c in pp.conversations("sgd", args.rows))
    key = {"recipe": recipe, "target": pr.dir_digest(Path(recipe["target"]["path"])), "code": pr.code_digest(),
        "conversations": hashlib.sha256(text.encode()).hexdigest(),
        "steps": args.steps, "threads": args.threads, "scoring": job, "peers": {p: pp.PEERS[p] for p in args.peers},
        "ours_base": args.ours_base, "grid": {"lr": args.lr, "ttt": args.ttt}}
    if args.kept:
        print_kept({k: v for k, v in key.items() if k != "grid"}, args)
        return 0
    trainers = ["ours", *args.peers]
    tuned = pr.kept(args.results / "tuned.json", key, args.reuse)
    if tuned is None:
        grid = run_grid(work / "sweep-sgd-1x-s0", key, args, recipe, job, text)
        tuned = pr.keep(args.results / "tuned.json", key, {
            **{t: best(grid, t) for t in trainers}, "ours_base": args.ours_base, "k": K, "grid": grid,
            "machine": sorted({g[t]["machine"] for g in grid for t in trainers}),
            "wall_s": round(sum(g[t]["wall_s"] for g in grid for t in trainers), 1)})
    print("\n| lr | TTT | " + " | ".join(f"{t} α_1 | {t} MAL" for t in trainers) + " | lossless |")
    print("|---:|---:|" + "---:|---:|" * len(trainers) + "---|")
    for g in tuned["grid"]:
        cells = " | ".join(f"{g[t]['alpha1']:.3f} | {g[t]['mal']:.3f}" for t in trainers)
        print(f"| {g['lr']:g} | {g['ttt']} | {cells} | {'yes' if all(g[t]['lossless'] for t in trainers) else 'NO'} |")
    for trainer in trainers:
        b = tuned[trainer]
        print(f"- best for {trainer}: lr {b['lr']:g}, TTT {b['ttt']} (MAL {b['mal']:.3f} at k = {K})")
    print(f"- the sweep's runs took {tuned['wall_s']:.0f} s in all, on {'; '.join(tuned['machine'])}")
    return 0


def run_grid(cell: Path, key: dict, args: argparse.Namespace, recipe: dict, job: dict, text: str) -> list[dict]:
    """Every grid point trained and scored in ``cell``: per point its lr, TTT and each trainer's α_1, MAL, drafts
    and whether its outputs were lossless. Each trainer's run at each point is kept on its own, under the sweep's
    key less the grid, so with ``--reuse`` a session cut short, or a wider grid, trains only the runs not kept."""
    without_grid = {k: v for k, v in key.items() if k != "grid"}
    pr.fresh(cell, without_grid, args.reuse)
    (cell / "conversations.jsonl").write_text(text)
    plain = functools.cache(lambda: pp.served({**job, "head": None}, cell, "vllm-plain"))
    grid = []
    for lr in args.lr:
        for ttt in args.ttt:
            runs = grid_point(cell, without_grid, recipe, lr, ttt, args, job, plain)
            point = {"lr": lr, "ttt": ttt}
            for trainer, outcome in runs.items():
                by_set = outcome["scores"][str(K)]
                a = pooled([r["counts"] for r in by_set.values()])
                point[trainer] = {"alpha1": round(a.alphas[0], 4), "mal": round(a.mal, 4), "drafts": a.drafts,
                                  "lossless": all(r["lossless"] for r in by_set.values()),
                                  "machine": outcome["machine"], "wall_s": outcome["wall_s"]}
            grid.append(point)
            print(f"peer_sweep: lr {lr:g}, TTT {ttt}: MAL " + ", ".join(f"{t} {point[t]['mal']:.3f}" for t in runs),
                  flush=True)
    return grid

if __name__ == "__main__":
    sys.exit(main())
