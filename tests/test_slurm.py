"""SLURM: rendering and submission (`mtp-train slurm`), the trainer's stop signal, and the chain on a real
local cluster (slurmctld plus two slurmd nodes, n1 and n2, started by tests/slurm/start.sh).

The cluster tests are marked `slurm`: deselect them with `-m "not slurm"`. They run wherever the cluster can be
started (root, and the SLURM daemons installed or apt-get to install them) and skip elsewhere, with the reason,
under CI=true too. Every SLURM command runs under `timeout`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_RECIPE, pause_env, paused_processes, resume, run_cli, signal_pending, stand_in_checkpoint
from precompute_helpers import make_recipe, sgd_rows, shard_contents, write_jsonl

HARNESS = REPO / "tests" / "slurm"
CHAIN_TIMEOUT = 900  # seconds for one whole chain; it takes about a minute and a half on 2 idle cores
TRAIN = {"batch_tokens": 1024, "lr": 3e-3, "warmup_steps": 2, "unroll": 2, "max_steps": 10, "val_every": 5,
         "save_every": 5, "wandb_mode": "disabled"}
EVAL = {"k": [1], "temperatures": [0.0], "prompt_sets": ["heldout"], "max_prompts": 4, "max_new_tokens": 8,
        "compare": []}
# The scripts' CPU mode runs one BLAS thread per process; the runs without SLURM do the same.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def small_recipe(tmp: Path, data_file: Path, **overrides) -> Path:
    sections = {"data": {"heldout_rows": 8}, "precompute": {"layers": [-1], "topk": 16}, "train": dict(TRAIN),
                "eval": dict(EVAL)}
    for section, values in overrides.items():
        sections[section].update(values)
    return make_recipe(tmp, data_file, **sections)


def mtp_train(*args, env=None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtp_train.cli", *map(str, args)], cwd=REPO, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def train_log(output_dir: Path, kind: str = "mtp") -> list[dict]:
    """The run's step records without their wall times (``step_s``), which differ between runs."""
    path = output_dir / f"train_log.{kind}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [{k: v for k, v in r.items() if k != "step_s"} for r in records]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "sgd.jsonl", sgd_rows(60, split="train"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """The same recipe without SLURM: precompute as 3 ranks (`--rank R --world-size 3`, as the array's 3 tasks;
    the trainer's batch plan follows the shards), then one training process with grad_accum=2, which has the
    global batch of 2 nodes x 1 process. Returns the output directory."""
    tmp = tmp_path_factory.mktemp("reference")
    recipe = small_recipe(tmp, data)
    ranks = [subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "precompute", str(recipe), "--rank", str(r),
                               "--world-size", "3"], cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    for rank in ranks:
        _, err = rank.communicate(timeout=600)
        assert rank.returncode == 0, err[-3000:]
    proc = mtp_train("train", recipe, "train.grad_accum=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


# ---- without a cluster ----------------------------------------------------------------------------------

def test_dry_run_prints_the_scripts_and_the_chained_sbatch_commands(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("slurm", TINY_RECIPE, f"output_dir={out}", "target.tp=2", "--nodes", "2", "--gpus-per-node", "8",
                   "--partition", "gpu", "--account", "proj", "--time", "48:00:00", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    scripts = {job: text.split(f"# ---- {out}/slurm/{job}.sbatch ----\n", 1)[1].split("# ---- ", 1)[0]
               for job in ("precompute", "verify", "train", "eval")}
    pre, train = scripts["precompute"], scripts["train"]
    assert "#SBATCH --array=0-7\n" in pre and "#SBATCH --gres=gpu:2\n" in pre  # 2 nodes x 8 GPUs / TP 2
    assert 'torchrun --standalone --nproc_per_node "$TP"' in pre and "TP=2\n" in pre
    assert "#SBATCH --nodes=2\n" in train and "#SBATCH --gres=gpu:8\n" in train and "export PROCS_PER_NODE=8" in train
    assert "#SBATCH --requeue\n" in train and "#SBATCH --signal=B:USR1@300\n" in train
    assert "#SBATCH --time=48:00:00\n" in train and "scontrol show hostnames" in train
    assert "--gres" not in scripts["verify"] and "python -m mtp_train.slurm merge" in scripts["verify"]
    for script in scripts.values():
        assert "#SBATCH --partition=gpu\n" in script and "#SBATCH --account=proj\n" in script
        assert "{{" not in script and "ACCELERATE_USE_CPU" not in script
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    commands = text.split("# ---- submission", 1)[1].splitlines()[1:]
    assert commands[0] == f"PRECOMPUTE=$(sbatch --parsable {out}/slurm/precompute.sbatch)"
    assert commands[1] == (f"VERIFY=$(sbatch --parsable --dependency=afterok:$PRECOMPUTE --kill-on-invalid-dep=yes "
                           f"{out}/slurm/verify.sbatch)")
    assert "--dependency=afterok:$VERIFY" in commands[2] and "--dependency=afterok:$TRAIN" in commands[3]
    assert not out.exists(), "a dry run writes nothing"


def test_the_docs_example_for_llama_70b_on_four_8xh100_nodes(tmp_path):
    """The worked example of docs/slurm.md: 4 array tasks with TP 8 on a node each, 32 training ranks, eval on 8 GPUs."""
    target = tmp_path / "target"  # Llama-3.3-70B's config, without weights
    target.mkdir()
    stand_in_checkpoint(target, REPO / "recipes" / "configs" / "llama-3.3-70b.json")
    proc = run_cli("slurm", REPO / "recipes/llama3.3-70b.yaml", f"target.path={target}", f"output_dir={tmp_path}",
                   "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--account", "myproj", "--time",
                   "48:00:00", "--setup", "module load cuda/12.4", "--venv", "/shared/mtp-train/.venv", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    pre, _, train, evaluation = proc.stdout.split("# ---- ")[1:5]
    assert "#SBATCH --array=0-3\n" in pre and "#SBATCH --gres=gpu:8\n" in pre and "TP=8\n" in pre
    assert "#SBATCH --nodes=4\n" in train and "export PROCS_PER_NODE=8\n" in train
    assert "#SBATCH --time=48:00:00\n" in train and "#SBATCH --gres=gpu:8\n" in evaluation
    assert "module load cuda/12.4\nsource /shared/mtp-train/.venv/bin/activate\n" in train
    # Each GPU job asks for the CPUs and memory of its plan, not the site's defaults (often one CPU).
    from mtp_train.host_plan import GIB, PROCESS_BYTES, eval_host, precompute_host, train_host
    from mtp_train.models.config import ModelConfig
    from mtp_train.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes/llama3.3-70b.yaml", [f"target.path={target}"])
    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()), "config.json")
    for script, plan in ((pre, precompute_host(recipe, cfg)), (train, train_host(recipe, cfg, 8)),
                         (evaluation, eval_host(recipe))):
        assert f"#SBATCH --cpus-per-task={plan.cpus}\n" in script and f"#SBATCH --mem={-(-plan.memory // GIB)}G\n" \
            in script, script[:1200]
        assert plan.cpus >= 8 * 9 and plan.memory >= 8 * PROCESS_BYTES  # 8 processes on each of these nodes


def test_cpu_mode_renders_gloo_fp32_scripts(tmp_path):
    proc = run_cli("slurm", TINY_RECIPE, f"output_dir={tmp_path}", "--cpu", "--nodes", "2", "--array-tasks", "3",
                   "--venv", "none", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "export ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1" in proc.stdout and "--gres" not in proc.stdout
    assert "OVERRIDES=(target.dtype=float32 'train.mixed_precision=\"no\"' output_dir=" in proc.stdout
    assert "#SBATCH --array=0-2\n" in proc.stdout and "bin/activate" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes: must be at least 1"),
    (["--gpus-per-node", "4", "target.tp=4", "--array-tasks", "x"], "argument --array-tasks: invalid int value"),
    (["--partition", "a b"], "--partition: 'a b' must be one word"),
    (["target.tp=2", "--gpus-per-node", "1"], "target.tp: 2 exceeds --gpus-per-node 1"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    proc = run_cli("slurm", TINY_RECIPE, f"output_dir={tmp_path}", *args, "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_no_sbatch_on_path_is_a_one_line_error(tmp_path):
    env = {**ENV, "PATH": str(Path(sys.executable).parent)}
    proc = mtp_train("slurm", TINY_RECIPE, f"output_dir={tmp_path}", "--cpu", env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "mtp-train: sbatch not found on PATH; run on a SLURM login node, or use --dry-run"
    assert not (tmp_path / "slurm").exists()


def test_trainer_stops_on_sigusr1_with_a_checkpoint_and_resumes_to_the_same_weights(tmp_path, data, reference):
    """SIGUSR1 reaches the trainer while it is paused after step 3 (the pause hook), between two checkpoints: it
    writes one, exits 75, and the rerun resumes from it to the uninterrupted run's weights."""
    recipe = small_recipe(tmp_path, data, train={"save_every": 50},
                          precompute={"features_dir": str(reference / "features")})
    cmd = [sys.executable, "-m", "mtp_train.cli", "train", str(recipe), "train.grad_accum=2"]
    env = {**pause_env("train", 3, tmp_path / "paused"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    (pid,) = paused_processes(tmp_path / "paused", 1, proc)
    os.kill(pid, signal.SIGUSR1)
    resume([pid])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = train_log(tmp_path / "run")[-1]["step"]
    assert stopped_at == 3 and f"stopped by SIGUSR1 after step {stopped_at}" in err
    assert (tmp_path / "run" / "checkpoints" / "mtp" / f"step-{stopped_at:08d}").is_dir()
    resumed = mtp_train("train", recipe, "train.grad_accum=2")
    assert resumed.returncode == 0 and f"resuming at step {stopped_at}" in resumed.stderr, resumed.stderr[-3000:]
    assert train_log(tmp_path / "run") == train_log(reference)
    a, b = (load_file(d / "heads" / "mtp" / "model.safetensors") for d in (tmp_path / "run", reference))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- on a real local cluster -----------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def cluster_unavailable() -> str | None:
    """Why tests/slurm/start.sh cannot start a cluster on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (apt-get, /etc/hosts, daemons): tests/slurm/start.sh"
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(tool) is None]
    if missing and shutil.which("apt-get") is None:
        return f"the local SLURM cluster needs {', '.join(missing)}, and there is no apt-get to install them"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """slurmctld and slurmd n1, n2 on localhost for this module; SLURM_CONF points the commands at them."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm-state")
    ports = free_ports(3)  # so that test runs side by side get clusters of their own
    env = {**os.environ, "MTP_SLURM_CTLD_PORT": str(ports[0]), "MTP_SLURM_NODE_PORTS": f"{ports[1]} {ports[2]}"}
    start = subprocess.run(["timeout", "900", "bash", str(HARNESS / "start.sh"), str(state)], capture_output=True,
                           text=True, env=env)
    assert start.returncode == 0, f"tests/slurm/start.sh failed:\n{start.stderr[-3000:]}"
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = ENV["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        yield state
    finally:
        subprocess.run(["timeout", "30", "scancel", "--user=root"], capture_output=True)  # this cluster's jobs only
        subprocess.run(["timeout", "120", "bash", str(HARNESS / "stop.sh"), str(state)], capture_output=True)
        ENV.pop("SLURM_CONF", None)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


def submit_chain(recipe: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`mtp-train slurm RECIPE --cpu --nodes 2 --array-tasks 3 --wait`, under `timeout`."""
    cmd = ["timeout", str(CHAIN_TIMEOUT), sys.executable, "-m", "mtp_train.cli", "slurm", str(recipe), "--cpu",
           "--nodes", "2", "--array-tasks", "3", *args, "--wait"]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=CHAIN_TIMEOUT + 30)


def job_ids(stdout: str) -> dict[str, str]:
    return {job: line.split(": ", 1)[1] for line in stdout.splitlines()
            for job in ("precompute", "verify", "train", "eval") if line.startswith(f"{job}: ")}


@pytest.fixture(scope="module")
def chain(cluster, tmp_path_factory, data):
    """The whole chain on the cluster: precompute as 3 array tasks, verify, training on 2 nodes x 1 process,
    eval. Returns the output directory and the command's result."""
    tmp = tmp_path_factory.mktemp("chain")
    recipe = small_recipe(tmp, data)
    started = time.monotonic()
    proc = submit_chain(recipe)
    print(f"chain: {time.monotonic() - started:.0f}s")
    return tmp / "run", proc


@pytest.mark.slurm
def test_chain_on_two_nodes_equals_a_run_without_slurm(chain, reference):
    out, proc = chain
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((out / "slurm" / "logs").glob("*")))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    ids = job_ids(proc.stdout)
    assert list(ids) == ["precompute", "verify", "train", "eval"] and len(set(ids.values())) == 4
    assert f"slurm: precompute: job {ids['precompute']} COMPLETED, 3 array tasks" in proc.stdout
    # Three array tasks wrote three ranks and read back their own shards; the final step checked the headers.
    features = out / "features"
    manifest = json.loads((features / "manifest.json").read_text())
    assert sorted(manifest["ranks"]) == [0, 1, 2] and manifest["world_size"] == 3
    log_dir = out / "slurm" / "logs"
    for rank in range(3):
        log = (log_dir / f"precompute-{ids['precompute']}_{rank}.out").read_text()
        assert f"precompute: rank {rank} read back its " in log, log[-2000:]
        assert "shards as they landed: sha256 as written" in log, log[-2000:]
    merged = (log_dir / f"verify-{ids['verify']}.out").read_text()
    assert "headers, and the rows' coverage: OK" in merged and "sha256 mismatch" not in merged, merged
    assert run_cli("verify", features).returncode == 0
    # Identical features, row by row (the runs shard them differently).
    ours, ref = shard_contents(features), shard_contents(reference / "features")
    assert sorted(ours) == sorted(ref)
    for row_id, tensors in ref.items():
        assert ours[row_id].keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert torch.equal(ours[row_id][name], tensor), f"row {row_id}: {name} differs"
    # Training ran as 2 processes, one per node, and ends at the same loss as 1 process x 2 micro-batches.
    train_out = (out / "slurm" / "logs" / f"train-{ids['train']}.out").read_text()
    assert "train: 2 node(s) (n[1-2]) x 1" in train_out and "2 process(es)" in train_out
    config = json.loads((out / "heads" / "mtp" / "config.json").read_text())
    assert len(config["rank_weight_sha256"]) == 2 and len(set(config["rank_weight_sha256"])) == 1
    ours_log, ref_log = train_log(out), train_log(reference)
    assert [r["step"] for r in ours_log] == list(range(1, TRAIN["max_steps"] + 1))
    for a, b in zip(ours_log, ref_log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert ours_log[-1]["val_loss"] == pytest.approx(ref_log[-1]["val_loss"], rel=1e-3)
    # The eval job wrote the report.
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report and all((out / "eval" / f"report.{ext}").is_file() for ext in ("md", "html"))


@pytest.mark.slurm
def test_training_signalled_mid_run_requeues_and_ends_with_the_same_weights(chain, tmp_path, data):
    """`scancel --signal=USR1 --batch`, as SLURM does before the time limit: the trainer checkpoints and exits,
    the job requeues itself, resumes from `latest`, and ends where the uninterrupted chain did."""
    from mtp_train.recipe import load_recipe
    from mtp_train.slurm import SlurmOptions, render, wait_chain, write_scripts

    uninterrupted, _ = chain
    recipe_path = small_recipe(tmp_path, data, precompute={"features_dir": str(uninterrupted / "features")})
    recipe = load_recipe(recipe_path)
    opts = SlurmOptions(nodes=2, cpu=True, venv=Path(sys.prefix), array_tasks=3)
    paths = write_scripts(render(recipe_path, [], recipe, opts), recipe)
    env = {**pause_env("train", 3, tmp_path / "paused"), **{k: ENV[k] for k in ("OMP_NUM_THREADS", "WANDB_MODE")}}
    submitted = subprocess.run(["timeout", "60", "sbatch", "--parsable", str(paths["train"])], env=env,
                               capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    ranks = paused_processes(tmp_path / "paused", 2)  # both nodes' trainers, paused after step 3
    signalled = subprocess.run(["timeout", "30", "scancel", "--signal=USR1", "--batch", job], capture_output=True,
                               text=True)
    assert signalled.returncode == 0, signalled.stderr
    deadline = time.monotonic() + 60  # the batch script forwards it through srun and torchrun to the paused ranks
    while not all(signal_pending(pid, signal.SIGUSR1) for pid in ranks):
        assert time.monotonic() < deadline, "SIGUSR1 did not reach the paused trainers"
        time.sleep(0.05)
    resume(ranks)
    result = wait_chain({"train": job}, timeout=CHAIN_TIMEOUT)
    log_text = (recipe.output_dir / "slurm" / "logs" / f"train-{job}.out").read_text()
    assert result.ok, "\n".join(result.lines) + "\n" + log_text[-4000:]
    assert "got SIGUSR1" in log_text and f"requeueing job {job}" in log_text and "restart 1" in log_text
    assert "stopped by SIGUSR1 after step 3" in log_text and "resuming at step 3" in log_text
    ours = train_log(recipe.output_dir)
    assert [r["step"] for r in ours] == list(range(1, TRAIN["max_steps"] + 1))
    assert [r["loss"] for r in ours] == [r["loss"] for r in train_log(uninterrupted)]
    a, b = (load_file(d / "heads" / "mtp" / "model.safetensors") for d in (recipe.output_dir, uninterrupted))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slurm
def test_a_failed_array_task_cancels_the_rest_of_the_chain_and_is_named(cluster, tmp_path, data):
    recipe = small_recipe(tmp_path, write_jsonl(tmp_path / "sgd.jsonl", sgd_rows(15, split="train")),
                          data={"heldout_rows": 2})
    # Rank 1's first shard path is taken by a directory, so array task 1 cannot clean or write it.
    (tmp_path / "run" / "features" / "shard-00001-00000.safetensors" / "taken").mkdir(parents=True)
    proc = submit_chain(recipe)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    ids = job_ids(proc.stdout)
    assert f"slurm: precompute: array task 1 (job {ids['precompute']}_1) FAILED, exit code 1:0" in proc.stderr
    assert "IsADirectoryError" in proc.stderr.split("array task 1", 1)[1].splitlines()[0]
    assert "array task 0" not in proc.stderr and "array task 2" not in proc.stderr
    for job in ("verify", "train", "eval"):
        assert (f"slurm: {job}: job {ids[job]} CANCELLED because an earlier job failed (DependencyNeverSatisfied); "
                f"it never ran") in proc.stderr
    assert not (tmp_path / "run" / "features" / "manifest.json").exists()


@pytest.mark.slurm
def test_the_online_chain_stores_nothing_and_trains_as_the_offline_one(cluster, tmp_path, data, reference):
    """``precompute.mode: online`` on the cluster: the array plans the shards (3 tasks, no target), verify checks
    the rows' coverage, each node's trainer scores its own shards beside its head, and the losses are the offline
    reference's (the same plan, 1 process x 2 micro-batches)."""
    recipe = small_recipe(tmp_path, data, precompute={"mode": "online"})
    proc = submit_chain(recipe)
    out = tmp_path / "run"
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((out / "slurm" / "logs").glob("*")))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    ids = job_ids(proc.stdout)
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    assert manifest["online"] and sorted(manifest["ranks"]) == [0, 1, 2] and manifest["totals"]["bytes"] == 0
    assert not list((out / "features").glob("shard-*"))
    assert "for online training (nothing stored)" in logs and "coverage: OK (online: nothing stored)" in logs
    train_out = (out / "slurm" / "logs" / f"train-{ids['train']}.out").read_text()
    scored = {line.split("rank ", 1)[1].split(":", 1)[0] for line in train_out.splitlines() if "online: scored" in line}
    assert scored == {"0", "1"}, train_out[-3000:]
    for a, b in zip(train_log(out), train_log(reference)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert (out / "eval" / "report.json").is_file()
