"""A job submitted twice: two real processes of one stage started at once on one output, for precompute (with
regeneration), training and eval. The one that takes the lock pauses there (the pause hook ``hold``), so that the
other surely starts while it holds it; the other refuses in one line naming the holder, with exit status 2, and the
first, continued, finishes whole. A lock whose process is gone is taken over with a one-line notice."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, pause_env, paused_processes, resume
from precompute_helpers import make_recipe, sgd_rows, write_jsonl

pytestmark = pytest.mark.slow


def _start_twice(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Start ``mtp-train ARGS`` twice at once, both with the pause hook at the lock: the (holder, refused) pair."""
    env = pause_env("hold", 0, tmp_path / "paused")
    procs = [subprocess.Popen([sys.executable, "-m", "mtp_train.cli", *args], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    (pid,) = paused_processes(tmp_path / "paused", 1, *procs)
    holder = next(p for p in procs if p.pid == pid)
    refused = next(p for p in procs if p.pid != pid)
    refused.wait(timeout=300)
    resume([pid])
    holder.wait(timeout=900)
    return holder, refused


def _assert_refused(refused: subprocess.Popen, holder: subprocess.Popen, stage: str, lock: Path) -> None:
    err = refused.stderr.read()
    assert refused.returncode == 2 and "Traceback" not in err, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mtp-train: {stage}") and f"{lock.parent} is being written by pid {holder.pid} on " \
        f"{socket.gethostname()}" in line, line
    assert not lock.exists(), "the holder gave its lock back"


def test_precompute_with_regeneration_submitted_twice(tmp_path):
    rows = [{"conversations": r["conversations"][:2]} for r in sgd_rows(3)]
    recipe = make_recipe(tmp_path, write_jsonl(tmp_path / "d.jsonl", rows),
                         data={"regenerate": True, "heldout_rows": 0,
                               "sampling": {"temperature": 0.0, "max_new_tokens": 12}})
    holder, refused = _start_twice(["precompute", str(recipe)], tmp_path)
    assert holder.returncode == 0, holder.stderr.read()[-3000:]
    features = tmp_path / "run" / "features"
    _assert_refused(refused, holder, "precompute rank 0", features / ".lock.rank-00000")
    check = subprocess.run([sys.executable, "-m", "mtp_train.cli", "verify", str(features)], cwd=REPO,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert len((features / "regenerated.rank-00000.jsonl").read_text().splitlines()) == 1 + 3
    assert not list(features.glob(".*.tmp"))


def test_training_submitted_twice(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run" / "features", run / "features")
    args = ["train", str(trained_run), f"output_dir={run}", "train.max_steps=4", "train.save_every=2"]
    holder, refused = _start_twice(args, tmp_path)
    assert holder.returncode == 0, holder.stderr.read()[-3000:]
    _assert_refused(refused, holder, "train (mtp head)", run / "checkpoints" / "mtp" / ".lock.rank-00000")
    assert [json.loads(line)["step"] for line in (run / "train_log.mtp.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (run / "heads" / "mtp" / "model.safetensors").is_file()


def test_eval_submitted_twice(trained_run, tmp_path):
    run = tmp_path / "run"
    for part in ("features", "heads"):
        shutil.copytree(trained_run.parent / "run" / part, run / part)
    args = ["eval", str(trained_run), f"output_dir={run}", "eval.compare=[]", "eval.k=[1]", "eval.max_prompts=2"]
    holder, refused = _start_twice(args, tmp_path)
    assert holder.returncode == 0, holder.stderr.read()[-3000:]
    _assert_refused(refused, holder, "eval", run / "eval" / ".lock.rank-00000")
    assert json.loads((run / "eval" / "report.json").read_text())["sweep"]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _lock_record(**fields) -> str:
    record = {"host": socket.gethostname(), "pid": _dead_pid(), "start": "1", "slurm_job": "", "slurm_restart": "0",
              "since": "2026-01-01 00:00:00", "command": "mtp-train precompute old.yaml"}
    return json.dumps({**record, **fields})


def _acquire(lock: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Take and give back ``lock`` in a process of its own, as a stage does; its CLI-style exit status."""
    code = ("import sys; from pathlib import Path; from mtp_train.errors import UserError\n"
            "from mtp_train.lock import exclusive\n"
            "try:\n    with exclusive(Path(sys.argv[1]), 'stage'): print('held')\n"
            "except UserError as e:\n    print(f'mtp-train: {e}', file=sys.stderr); sys.exit(2)\n")
    return subprocess.run([sys.executable, "-c", code, str(lock)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_notice(tmp_path):
    lock = tmp_path / ".lock.rank-00000"
    lock.write_text(_lock_record())
    proc = _acquire(lock)
    assert proc.returncode == 0 and proc.stdout == "held\n", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"mtp-train: stage: taking over {lock} from pid ") and "whose process is gone" in line
    assert not lock.exists()


def test_a_live_holder_on_this_host_or_another_is_refused(tmp_path):
    lock = tmp_path / ".lock.rank-00000"
    for host, pid, hint in ((socket.gethostname(), os.getpid(), "wait for it to end or stop it"),
                            ("node-17", 4242, f"if that job is gone, delete {lock}")):
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] if pid == os.getpid() else "9"
        lock.write_text(_lock_record(host=host, pid=pid, start=start))
        proc = _acquire(lock)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert f"is being written by pid {pid} on {host}" in line and hint in line, line
        assert json.loads(lock.read_text())["pid"] == pid, "a live holder's lock is left as it is"


def test_a_requeued_slurm_job_takes_over_its_own_earlier_lock_from_another_host(tmp_path):
    lock = tmp_path / ".lock.rank-00000"
    lock.write_text(_lock_record(host="node-17", pid=4242, slurm_job="977", slurm_restart="0"))
    same_run = _acquire(lock, {"SLURM_JOB_ID": "977", "SLURM_RESTART_COUNT": "0"})
    assert same_run.returncode == 2, same_run.stderr  # the same run of the job on another node: still live
    requeued = _acquire(lock, {"SLURM_JOB_ID": "977", "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0 and "taking over" in requeued.stderr, requeued.stderr
    assert not lock.exists()


def test_a_pid_reused_by_another_process_does_not_hold_the_lock(tmp_path):
    lock = tmp_path / ".lock.rank-00000"
    lock.write_text(_lock_record(pid=os.getpid(), start="1"))  # this pid, but a process started at another time
    proc = _acquire(lock)
    assert proc.returncode == 0 and "taking over" in proc.stderr, proc.stderr


def test_a_stage_that_writes_nothing_leaves_no_folder_behind(tmp_path):
    from mtp_train.lock import exclusive

    lock = tmp_path / "out" / "eval" / ".lock.rank-00000"
    with exclusive(lock, "eval"):
        assert lock.is_file()
    assert list(tmp_path.iterdir()) == []
    with exclusive(lock, "eval"):
        (lock.parent / "report.json").write_text("{}")
    assert sorted(p.name for p in lock.parent.iterdir()) == ["report.json"]
