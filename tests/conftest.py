"""Shared fixtures: the repo root, the tiny default, and a CLI runner."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO / "recipes" / "tiny" / "target"
TINY_RECIPE = REPO / "recipes" / "tiny.yaml"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def run_cli(*args: str | os.PathLike[str], cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``mtp-train ARGS`` in a real subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "mtp_train.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit status 2, nothing on stdout, and one line on stderr holding every needle (no traceback)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


def pause_env(point: str, index: int, directory: Path) -> dict[str, str]:
    """The environment that makes a run stop itself (SIGSTOP) at ``point:index`` (``mtp_train.io.pause_point``),
    first leaving a file named by its pid in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "MTP_TRAIN_PAUSE_AT": f"{point}:{index}", "MTP_TRAIN_PAUSE_DIR": str(directory)}


def _proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def paused_processes(directory: Path, count: int, *launched: subprocess.Popen, timeout: float = 600) -> list[int]:
    """The pids of the ``count`` processes that stopped themselves at the pause hook (``pause_env``), once every one
    is stopped: a state that lasts until the test continues them with SIGCONT. Fails at once if every one of
    ``launched`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = [p.poll() for p in launched]
        assert not launched or None in ended, f"the run(s) ended unpaused, with status {ended}"
        pids = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
        if len(pids) == count and all(_proc_status(pid)["State"].startswith("T") for pid in pids):
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{count} process(es) did not pause within {timeout} s: {directory}")


def signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits to be delivered to process ``pid`` (a stopped process keeps it until continued)."""
    status = _proc_status(pid)
    return any(int(status[key], 16) >> (signum - 1) & 1 for key in ("ShdPnd", "SigPnd"))


def resume(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def vllm_check(recipe: Path, work: Path, *options: str) -> subprocess.CompletedProcess:
    """``bench/vllm_check.py`` on ``recipe``'s trained head with ``options`` (``--k``, ``--format``), its work files
    under ``work``; skips the test where `make vllm`'s environment is absent."""
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM's CPU build is not installed ({VLLM_PYTHON} is absent): `make vllm` creates it")
    return subprocess.run([sys.executable, str(REPO / "bench" / "vllm_check.py"), str(recipe), *options, "--work",
                           str(work)], cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})


@pytest.fixture
def cli():
    return run_cli


def _tiny_run(tmp: Path, head: dict, unroll: int, k: list[int]) -> Path:
    """Features of 60 SGD dialogues on the tiny target (8 held out) and a head trained on them for 60 steps; the
    recipe path (outputs under ``run/`` beside it)."""
    from precompute_helpers import make_recipe, sgd_rows, write_jsonl

    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(60, split="train"))
    recipe = make_recipe(
        tmp, data, data={"heldout_rows": 8}, precompute={"layers": [-1], "topk": 16}, head=head,
        train={"batch_tokens": 2048, "lr": 3e-3, "warmup_steps": 5, "unroll": unroll, "max_steps": 60, "val_every": 60,
               "save_every": 60, "wandb_mode": "disabled"},
        eval={"k": k, "temperatures": [0.0], "prompt_sets": ["heldout"], "max_prompts": 8, "max_new_tokens": 24},
    )
    for stage in ("precompute", "train"):
        proc = run_cli(stage, recipe, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return recipe


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A small real run on the tiny target: an ``mtp`` head (2 unrolled steps) on ``_tiny_run``'s features."""
    return _tiny_run(tmp_path_factory.mktemp("trained"), {"kind": "mtp"}, 2, [1, 2])


@pytest.fixture(scope="session")
def eagle3_run(tmp_path_factory) -> Path:
    """An ``eagle3`` head on the same kind of run: aux layers [1, 2, 3] (precompute adds the outputs of layers 0-2 to
    the last one's), a draft vocabulary of 1,024 of the 4,096 ids, 3 unrolled steps of training-time test."""
    return _tiny_run(tmp_path_factory.mktemp("eagle3"), {"kind": "eagle3", "aux_layers": [1, 2, 3], "draft_vocab": 1024},
                     3, [1, 2, 3])


@pytest.fixture(scope="session")
def dflash_run(tmp_path_factory) -> Path:
    """A ``dflash`` head on the same kind of run: aux layers [1, 2, 3], blocks of 5 (k up to 4) at every anchor."""
    return _tiny_run(tmp_path_factory.mktemp("dflash"), {"kind": "dflash", "aux_layers": [1, 2, 3], "block_size": 5},
                     1, [1, 2, 4])


@pytest.fixture(scope="session")
def peagle_run(tmp_path_factory) -> Path:
    """A P-EAGLE head (``eagle3`` with ``parallel_drafts`` 4) on the same kind of run: aux layers [1, 2, 3], a draft
    vocabulary of 1,024 ids, its first step and three mask positions trained."""
    return _tiny_run(tmp_path_factory.mktemp("peagle"), {"kind": "eagle3", "aux_layers": [1, 2, 3], "draft_vocab": 1024,
                                                          "parallel_drafts": 4}, 1, [1, 2, 4])


def hf_tokenizer(root: Path):
    """The tokenizer of the HF checkpoint at ``root``, offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root, local_files_only=True)


def hf_model(root: Path):
    """The transformers model of the checkpoint at ``root``, offline, fp32, eval mode (seed 0 first)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=torch.float32).eval()


def greedy_distinct2(model, tokenizer, seed: int, prompts: int = 50, new_tokens: int = 48) -> float:
    """Distinct-2 of the greedy replies (batched) to the first turns of ``prompts`` SGD dev dialogues drawn with
    ``seed``, as a tiny target's build script measures it."""
    import random

    import torch

    from mtp_train.tools.tiny_target import distinct_n, read_sgd

    first_turns = [d[:1] for d in random.Random(seed).sample(read_sgd("dev"), prompts)]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # the prompts end where generation starts
    try:
        batch = tokenizer.apply_chat_template(first_turns, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True, padding=True)
    finally:
        tokenizer.padding_side = side
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    pad, start = tokenizer.pad_token_id, batch["input_ids"].shape[1]
    return distinct_n([[t for t in row if t != pad] for row in out[:, start:].tolist()], 2)  # padded after each end


def stand_in_checkpoint(root: Path, config: Path) -> Path:
    """A checkpoint directory a dry run accepts without weights: the real ``config``, a weight index naming an
    empty file (a dry run reads no weight) and the tiny target's tokenizer; beside it ``data.jsonl``, one chat row.
    Returns ``root``."""
    import shutil

    shutil.copy(config, root / "config.json")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "w.safetensors"}}))
    (root / "w.safetensors").write_bytes(b"")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_TARGET / name, root / name)
    chat = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]}
    (root / "data.jsonl").write_text(json.dumps(chat) + "\n")
    return root


def sgd_chat_prompts(count: int, cycle: int) -> list[list[int]]:
    """``count`` chat prompts for the tiny target from the SGD dev split; prompt i holds 2·(i mod cycle)+1 turns."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    with gzip.open(REPO / "data/sgd/sgd_dev_sharegpt.jsonl.gz", "rt") as f:
        rows = [json.loads(next(f)) for _ in range(count)]
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for i, row in enumerate(rows):
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"][: 2 * (i % cycle) + 1]]
        out.append(tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    return out
