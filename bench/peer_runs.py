"""Each trainer's run in one cell of bench/peer_parity.py (and bench/peer_sweep.py): ours through the CLI, the peers
(SpecForge 0.2.0, speculators 0.9.0) through their runners in bench/peers/, each in its own virtualenv, on the token
ids and loss masks our precompute stored, at our number of optimizer steps and tokens per step; and the keys that
decide whether a run is kept (a run is redone unless ``--reuse`` is asked and its key still matches).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.machine import machine_line  # noqa: E402
from mtp_train.io import write_json_atomic  # noqa: E402
from mtp_train.recipe import apply_overrides  # noqa: E402

PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
RECIPE = REPO / "recipes" / "smollm2.yaml"
SGD = REPO / "data" / "sgd" / "sgd_train_sharegpt.jsonl.gz"
DOLLY = REPO / "data" / "general" / "prompts.jsonl.gz"
MTP_TRAIN = [sys.executable, "-m", "mtp_train.cli"]
# The code that trains, exports and serves our runs. The drivers (bench/peer_parity.py, bench/peer_sweep.py) are left
# out: what they decide is in each key as data (the conversations' sha256, settings, overrides, steps, seed, scoring
# job), so a fix to how they print or order the runs keeps the runs already made.
CODE = ["mtp_train", "precompute", "eval", "bench/peers", "bench/peer_runs.py", "bench/vllm_serve.py",
        "bench/vllm_check.py"]
# A peer's run is keyed by its content instead: its job (the sha256 of the tokens our precompute handed it, its
# settings, steps, tokens per step, seed, threads), our draft vocabulary's sha256 where it takes ours, the target's
# weights, the scoring job, and this code: its runner and the serving path. So a change to our trainer retrains ours
# and keeps the peers' runs whose inputs it leaves as they were.
PEER_CODE = ["bench/peers", "bench/vllm_serve.py"]
JOB_PATHS = ("target", "tokens", "vocab", "out")  # where a job's inputs and outputs lie: keyed by content instead
RESULTS = REPO / "bench" / "peer_results"  # every trainer's run, each cell's and the sweep's, committed as they land
WORKERS = 1  # loader threads, every side: ours prefetches its batches on one thread
# SpecForge 0.2.0's own defaults (its config schema and every EAGLE-3 example; gradient clipping 0.5, AdamW betas
# (0.9, 0.999) and the cosine to 0 are fixed in its code): lr, TTT length, warm-up ratio and a 32k draft vocabulary
# of its own, from the trained ids.
SPECFORGE = {"lr": 1e-4, "ttt_length": 7, "warmup_ratio": 0.015, "vocab": None, "draft_vocab": 32000,
             "workers": WORKERS}
# speculators 0.9.0's own defaults (its train/config/schema.py; linear warm-up over 1% of the steps, then linear decay
# to 0, clipping 1.0 and equal TTT step weights are fixed or left at its defaults): Muon at lr 1e-3, 3 TTT steps, the
# full target vocabulary.
SPECULATORS = {"lr": 1e-3, "ttt_steps": 3, "optimizer": "muon", "vocab": None, "draft_vocab": None,
               "workers": WORKERS}
TTT = {"specforge": "ttt_length", "speculators": "ttt_steps"}  # each runner's name for the TTT length
RUNNERS = {"specforge": (PEERS_PYTHON, "peers"), "speculators": (SPECULATORS_PYTHON, "speculators")}


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """``cmd`` with its output appended to ``log``; a failure stops the benchmark naming the log."""
    with open(log, "a") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"peer_runs: {' '.join(map(str, cmd[:4]))} ... failed (exit {proc.returncode}); see {log}")


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def code_digest(paths: list[str] = CODE) -> str:
    """One sha256 over every file under ``paths`` (relative to the repository; caches left out), names included."""
    digest = hashlib.sha256()
    for top in paths:
        files = [REPO / top] if (REPO / top).is_file() else sorted((REPO / top).rglob("*"))
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts:
                digest.update(f"{f.relative_to(REPO)}\0{sha256_of(f)}\0".encode())
    return digest.hexdigest()


@functools.cache
def peer_code_digest() -> str:
    """One sha256 over ``PEER_CODE`` and the function that launches vLLM (bench/vllm_check.py's ``serve``, with its
    KV budget)."""
    from bench.vllm_check import KV_BYTES, serve

    return hashlib.sha256(f"{code_digest(PEER_CODE)}\0{inspect.getsource(serve)}\0{KV_BYTES}".encode()).hexdigest()


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
    write_json_atomic(stored, key)
    return True


def key_sha(key: dict) -> str:
    """The sha256 of a key as canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def kept(path: Path, key: dict, reuse: bool) -> dict | None:
    """The outcome stored at ``path`` when ``reuse`` is asked and it was made under ``key``; else None."""
    if reuse and path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("key_sha256") == key_sha(key):
            return stored
    return None


def keep(path: Path, key: dict, outcome: dict) -> dict:
    """Store ``outcome`` at ``path`` (atomically) under ``key``'s digest; returns what was stored."""
    stored = {"key_sha256": key_sha(key), **outcome}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, stored)
    return stored


def unit(path: Path, key: dict, reuse: bool, make: Callable[[], tuple[dict, Path]], score: Callable[[Path], dict]
         ) -> dict:
    """One trainer's run, the part a session keeps as soon as it ends: ``{"cost", "scores", "machine", "wall_s"}``
    stored at ``path`` under ``key``. Unless ``reuse`` finds it kept, trained (``make``: its cost and exported head)
    and scored (``score``: the head's vLLM results); a session cut short loses only the run it was in. ``machine``
    names the CPU (no bandwidth), so costs are set side by side only within one machine."""
    outcome = kept(path, key, reuse)
    if outcome is None:
        started = time.monotonic()
        cost, head = make()
        machine = machine_line(bandwidth=False)
        outcome = keep(path, key, {"cost": {**cost, "machine": machine}, "scores": score(head), "machine": machine,
                                   "wall_s": round(time.monotonic() - started, 1)})
    return json.loads(json.dumps(outcome))  # as kept: k as a string


def base_recipe() -> dict:
    """recipes/smollm2.yaml as a dict, its target path made absolute and its warm-up the one the table ran with."""
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["target"]["path"] = str((RECIPE.parent / recipe["target"]["path"]).resolve())
    recipe["train"]["warmup_steps"] = 10  # the table's runs (the recipe's one-hour run warms up over 20 since)
    return recipe


def overrides_arg(text: str) -> list[str]:
    """Recipe overrides joined by ";" as a list: ``"train.optimizer=muon;head.draft_vocab=null"`` -> its two; ``""``
    -> none."""
    return [o for o in text.split(";") if o]


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
    recipe["train"].update(max_steps=steps, val_every=10**6, save_every=10**6, wandb_mode="disabled",
                           tau_every=0)  # (no held-out rows here: the comparison scores in vLLM)
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
            "bytes_per_token": sum(f.stat().st_size for f in features.iterdir()) / stored["totals"]["tokens"],
            "handover": handover(cell, name)}


def handover(cell: Path, ours: str) -> dict:
    """What a peer takes from our run ``CELL/OURS`` (:func:`peer_inputs`), as content: the stored tokens' sha256 and
    mean length, the draft vocabulary's sha256 (None: the head drafts the full vocabulary)."""
    tokens, vocab, mean_len = peer_inputs(cell, ours)
    return {"tokens_sha256": sha256_of(tokens), "mean_len": mean_len,
            "vocab_sha256": sha256_of(vocab) if vocab is not None else None}


def peer_inputs(cell: Path, ours: str = "ours") -> tuple[Path, Path | None, float]:
    """Our stored token ids and loss masks (of our run ``CELL/OURS``) as the peers' JSONL input
    (``CELL/OURS.tokens.jsonl``), our draft vocabulary as their mapping (``CELL/OURS.vocab.safetensors``; None where
    the head drafts the full vocabulary), and the mean conversation length."""
    from safetensors.torch import load_file, save_file

    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(cell / ours / "features")
    tokens, lengths = cell / f"{ours}.tokens.jsonl", []
    with open(tokens, "w") as f:
        for ref in reader.train:
            rows = reader.load(ref)
            lengths.append(len(rows["input_ids"]))
            f.write(json.dumps({k: rows[k].tolist() for k in ("input_ids", "loss_mask")}) + "\n")
    head, vocab = load_file(cell / f"{ours}-vllm" / "model.safetensors"), cell / f"{ours}.vocab.safetensors"
    if "d2t" in head:
        save_file({"d2t": head["d2t"], "t2d": head["t2d"]}, vocab)
    return tokens, vocab if "d2t" in head else None, sum(lengths) / len(lengths)


def with_point(peer: str, settings: dict, lr: float, ttt: int) -> dict:
    """``settings`` of ``peer`` with its lr and TTT length set (each runner names the TTT length its own way)."""
    return {**settings, "lr": lr, TTT[peer]: ttt}


def peer_job(peer: str, cell: Path, ours: str, cost: dict, recipe: dict, settings: dict, threads: int, seed: int,
             name: str) -> dict:
    """The job of ``peer`` (``specforge`` or ``speculators``; bench/peers/{peer}_run.py's fields) into ``CELL/NAME``
    on the inputs of our run ``CELL/OURS`` (``cost``: its cost with its handover), as many optimizer steps as ours
    took, each carrying our mean tokens per step (SpecForge: that many rows on average; speculators: packed to that
    many tokens). ``settings``: the peer's, ``"vocab": "ours"`` for our draft vocabulary or ``None`` for its own."""
    per_step, mean_len = cost["tokens_trained"] / cost["steps"], cost["handover"]["mean_len"]
    shape = {"batch_size": max(1, round(per_step / mean_len))} if peer == "specforge" else {"seq_len": round(per_step)}
    return {"target": recipe["target"]["path"], "tokens": str(cell / f"{ours}.tokens.jsonl"),
            "max_length": recipe["data"]["max_length"], **settings,
            "vocab": str(cell / f"{ours}.vocab.safetensors") if settings["vocab"] == "ours" else None, **shape,
            "total_steps": cost["steps"], "seed": seed, "threads": threads, "out": str(cell / name),
            "tokens_sha256": cost["handover"]["tokens_sha256"]}


def peer_key(peer: str, job: dict, cost: dict, scoring: dict) -> dict:
    """The key a peer's run is kept under: its job less its paths, our draft vocabulary's sha256 where it takes ours
    (``cost``: our run's), the target's weights, ``scoring`` (the vLLM job and draft lengths) and ``PEER_CODE``."""
    return {"trainer": peer, "job": {k: v for k, v in job.items() if k not in JOB_PATHS},
            "vocab_sha256": cost["handover"]["vocab_sha256"] if job["vocab"] else None,
            "target": target_digest(job["target"]), "scoring": scoring, "code": peer_code_digest()}


@functools.cache
def target_digest(path: str) -> str:
    """:func:`dir_digest` of a target's directory, read once per process (its weights do not change under a run)."""
    return dir_digest(Path(path))


def train_peer(peer: str, job: dict, cell: Path, name: str) -> dict:
    """``peer``'s run of ``job`` (:func:`peer_job`) into ``CELL/NAME``: its result.json, kept while the job is
    unchanged, with its bytes per token at bf16."""
    out = Path(job["out"])
    done, asked = out / "result.json", cell / f"{name}-job.json"
    if not done.is_file() or json.loads(done.read_text())["job"] != json.loads(json.dumps(job)):
        asked.write_text(json.dumps(job, indent=1))
        run([str(RUNNERS[peer][0]), str(REPO / "bench" / "peers" / f"{peer}_run.py"), str(asked)],
            cell / f"{name}.log")
    result = json.loads(done.read_text())
    # Both runners store 4 states per token (SpecForge: the 3 aux and the last; speculators: 4 slots) in fp32; at
    # bf16, ours' dtype, each element takes 2 bytes less and nothing else changes.
    hidden = json.loads((Path(job["target"]) / "config.json").read_text())["hidden_size"]
    return {**result, "bytes_per_token_bf16": result["bytes_per_token"] - 2 * 4 * hidden}
