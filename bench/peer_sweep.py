"""Each trainer at its best for bench/peer_parity.py's ``tuned`` row: learning rate × TTT length, the same grid for
both, trained on one cell (SGD as written, scale 1, seed 0) and chosen by vLLM's mean acceptance length at k = 3 on a
validation split, SGD training dialogues that no cell trains on.

    make smollm2 vllm peers
    .venv/bin/python bench/peer_sweep.py [--lr 1e-4 3e-4 1e-3 3e-3] [--ttt 2 7]
    .venv/bin/python bench/peer_parity.py --settings defaults tuned

At each grid point: ours is recipes/smollm2.yaml with ``train.lr`` and ``train.unroll`` set; SpecForge is at its own
defaults (warm-up ratio, its own 32k draft vocabulary) with that lr and ``ttt_length``, at our number of optimizer
steps and tokens per step, as in peer_parity. Each keeps its other defaults. The validation prompts are the first
user turns of SGD training dialogues from row ``--rows`` × 4 on (peer_parity's largest cell trains on rows below
that), ``--prompts`` of them. Writes ``WORK/tuned.json`` (each trainer's best point and the whole grid) and prints
the grid. Like peer_parity: from scratch unless ``--reuse``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench.machine import machine_line  # noqa: E402

import peer_parity as pp  # noqa: E402
from peer_table import pooled  # noqa: E402

K = 3


def validation_prompts(first_row: int, n: int) -> dict[str, list[list[int]]]:
    """``{"validation": token ids}``: the first user turns of SGD training dialogues from ``first_row`` on."""
    from transformers import AutoTokenizer

    from mtp_train.data.dataset import load_rows
    from mtp_train.eval.prompts import load_prompt_set, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(REPO / ".cache" / "smollm2-135m-instruct")
    rows = [r for r in load_rows([pp.SGD], "sharegpt", False, first_row + 4 * n).rows if r.row_id >= first_row]
    prompts = load_prompt_set("heldout", heldout_rows=rows, max_prompts=n)
    return {"validation": [render_prompt(tokenizer, p.messages) for p in prompts]}


def grid_point(cell: Path, recipe: dict, lr: float, ttt: int, steps: int, threads: int) -> dict[str, Path]:
    """Both trainers at one point of the grid (seed 0); their exported heads."""
    overrides = [f"train.lr={lr}", f"train.unroll={ttt}"]
    mine = pp.ours_name(overrides)
    ours = pp.train_ours(cell, steps, overrides, 0, mine)
    peer = f"specforge-lr{lr:g}-ttt{ttt}"
    pp.train_specforge(cell, ours, recipe, {**pp.SPECFORGE, "lr": lr, "ttt_length": ttt}, threads, 0, peer, mine)
    return {"ours": cell / f"{mine}-vllm", "specforge": cell / peer / "vllm"}


def best(grid: list[dict], trainer: str) -> dict:
    """The grid point with the highest MAL of ``trainer`` (the earlier point on a tie)."""
    point = max(grid, key=lambda g: g[trainer]["mal"])
    return {"lr": point["lr"], "ttt": point["ttt"], "mal": point[trainer]["mal"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3])
    parser.add_argument("--ttt", type=int, nargs="+", default=[2, 7])
    parser.add_argument("--rows", type=int, default=80, help="conversations trained on (peer_parity's scale 1)")
    parser.add_argument("--steps", type=int, default=30, help="our optimizer steps (peer_parity's scale 1)")
    parser.add_argument("--prompts", type=int, default=16, help="validation prompts")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peers")
    parser.add_argument("--reuse", action="store_true", help="keep runs whose key matches (default: from scratch)")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    for python, make in ((pp.VLLM_PYTHON, "vllm"), (pp.PEERS_PYTHON, "peers")):
        if not python.is_file():
            sys.exit(f"peer_sweep: {python} not found; run `make {make}` first")
    work = args.work.resolve()
    recipe = pp.base_recipe()
    sets = validation_prompts(args.rows * 4, args.prompts)
    job = pp.scoring_job(recipe, sets, args.new_tokens, K)
    text = "".join(json.dumps(c) + "\n" for c in pp.conversations("sgd", args.rows, work, args.rows))
    key = {"recipe": recipe, "target": pp.dir_digest(Path(recipe["target"]["path"])), "code": pp.code_digest(
        pp.CODE + ["bench/peer_sweep.py"]), "conversations": hashlib.sha256(text.encode()).hexdigest(),
        "steps": args.steps, "threads": args.threads, "scoring": job, "specforge": pp.SPECFORGE}
    cell = work / "sweep-sgd-1x-s0"
    pp.fresh(cell, key, args.reuse)
    (cell / "conversations.jsonl").write_text(text)
    plain = pp.served({**job, "head": None}, cell, "vllm-plain")
    grid = []
    for lr in args.lr:
        for ttt in args.ttt:
            heads = grid_point(cell, recipe, lr, ttt, args.steps, args.threads)
            scores = pp.score(cell, job, plain, [K], heads)
            point = {"lr": lr, "ttt": ttt}
            for trainer, by_k in scores.items():
                a = pooled([r["counts"] for r in by_k[K].values()])
                point[trainer] = {"alpha1": round(a.alphas[0], 4), "mal": round(a.mal, 4), "drafts": a.drafts,
                                  "lossless": all(r["lossless"] for r in by_k[K].values())}
            grid.append(point)
            print(f"peer_sweep: lr {lr:g}, TTT {ttt}: MAL ours {point['ours']['mal']:.3f}, SpecForge "
                  f"{point['specforge']['mal']:.3f}", flush=True)
    tuned = {"ours": best(grid, "ours"), "specforge": best(grid, "specforge"), "k": K, "grid": grid, "key": key}
    (work / "tuned.tmp").write_text(json.dumps(tuned, indent=1))
    os.replace(work / "tuned.tmp", work / "tuned.json")
    print("\n| lr | TTT | ours α_1 | ours MAL | SpecForge α_1 | SpecForge MAL | lossless |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for g in grid:
        o, s = g["ours"], g["specforge"]
        print(f"| {g['lr']:g} | {g['ttt']} | {o['alpha1']:.3f} | {o['mal']:.3f} | {s['alpha1']:.3f} | {s['mal']:.3f} | "
              f"{'yes' if o['lossless'] and s['lossless'] else 'NO'} |")
    for trainer in ("ours", "specforge"):
        b = tuned[trainer]
        print(f"- best for {trainer}: lr {b['lr']:g}, TTT {b['ttt']} (MAL {b['mal']:.3f} at k = {K})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
