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
    """A hold as this tool writes it: by default, of a process on this machine that is gone."""
    record = {"host": socket.gethostname(), **_this_machine(), "pid": _dead_pid(), "start": "1", "slurm_job": "",
              "slurm_restart": "0", "since": "2026-01-01 00:00:00", "command": "mtp-train precompute old.yaml"}
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


# ---- one features directory, one layout; who a holder is; the takeover; a hold that keeps vanishing ----------------

def _this_machine() -> dict[str, str]:
    """What a hold records of this machine besides its host name: the boot and the pid namespace."""
    return {"boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pid_ns": str(os.stat("/proc/self/ns/pid").st_ino)}


def _precompute(recipe: Path, rank: int, world: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "precompute", str(recipe), "--rank", str(rank),
                             "--world-size", str(world)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_precomputes_of_another_world_size_refuse_a_directory_whose_ranks_share_it(tmp_path):
    """Rank 0 of 2 holds the features directory (paused at its lock); rank 2 of 3 started there refuses in one line
    naming it and the world sizes, and writes nothing; rank 1 of 2, a rank of the same job, runs beside it to the
    end; continued, rank 0 merges both."""
    recipe = make_recipe(tmp_path, write_jsonl(tmp_path / "d.jsonl", sgd_rows(6)), data={"heldout_rows": 1})
    features = tmp_path / "run" / "features"
    first = _precompute(recipe, 0, 2, pause_env("hold", 0, tmp_path / "paused"))
    other = None
    try:
        (pid,) = paused_processes(tmp_path / "paused", 1, first)
        other = _precompute(recipe, 2, 3)
        _, err = other.communicate(timeout=300)
        assert other.returncode == 2 and "Traceback" not in err, err[-3000:]
        (line,) = err.strip().splitlines()
        assert line.startswith(f"mtp-train: precompute rank 2: {features} is being written by pid {pid} on "
                               f"{socket.gethostname()}") and "world size 2" in line and "world size 3" in line, line
        assert not list(features.glob("*rank-00002*")), "the refused run wrote nothing"
        same_job = _precompute(recipe, 1, 2)
        out, err = same_job.communicate(timeout=300)
        assert same_job.returncode == 0 and "waiting for other ranks" in out, err[-3000:]
    finally:
        resume([first.pid])
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    merged = json.loads((features / "manifest.json").read_text())
    assert sorted(merged["ranks"]) == [0, 1] and merged["world_size"] == 2
    check = subprocess.run([sys.executable, "-m", "mtp_train.cli", "verify", str(features)], cwd=REPO,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert not list(features.glob(".lock*")), "every hold was given back"


def test_the_merged_manifest_is_written_under_the_merge_hold_and_another_layout_keeps_it(tmp_path, monkeypatch):
    """Whoever writes or drops ``manifest.json`` holds the merge lock meanwhile; a later precompute of another world
    size in the directory refuses in one line instead of deleting the complete merged manifest there."""
    from mtp_train.errors import UserError
    from mtp_train.lock import _read
    from mtp_train.precompute import run
    from mtp_train.recipe import load_recipe

    recipe = load_recipe(make_recipe(tmp_path, write_jsonl(tmp_path / "d.jsonl", sgd_rows(6)),
                                     data={"heldout_rows": 1}, precompute={"layers": [-1], "topk": 4}))
    features = tmp_path / "run" / "features"
    holders = []
    merge = run.merge_manifests
    monkeypatch.setattr(run, "merge_manifests", lambda out, world: holders.append(
        {k: v for k, v in (_read(out / ".lock.merge") or {}).items() if k in ("pid", "host")}) or merge(out, world))
    for rank in (1, 0):
        run.run_precompute(recipe, rank=rank, world=2)
    assert holders == [{"pid": os.getpid(), "host": socket.gethostname()}] * 2, holders
    merged = (features / "manifest.json").read_text()
    with pytest.raises(UserError) as e:
        run.run_precompute(recipe, rank=2, world=3)
    assert f"{features / 'manifest.json'}" in str(e.value) and "--overwrite" in str(e.value), e.value
    assert (features / "manifest.json").read_text() == merged, "the complete merged manifest is kept"
    assert not list(features.glob(".lock*"))


def test_a_holder_on_a_host_of_the_same_name_with_another_boot_or_pid_namespace_is_not_taken_over(tmp_path):
    """Two machines of one host name, or containers sharing one in separate pid namespaces: the holder's pid says
    nothing here, so its hold is kept (as another host's is) and the refusal says what to do if it is gone."""
    lock = tmp_path / ".lock.rank-00000"
    for other in ({"boot_id": "0d6f3e0a-0000-4000-8000-000000000000"}, {"pid_ns": "4026531000"}):
        written = _lock_record(**other)
        lock.write_text(written)
        proc = _acquire(lock)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "is being written by pid" in line and f"if that job is gone, delete {lock}" in line, line
        assert lock.read_text() == written, "the hold is kept as it is"
    # the same machine (host, boot and pid namespace): a gone pid is taken over, as before
    lock.write_text(_lock_record())
    proc = _acquire(lock)
    assert proc.returncode == 0 and "taking over" in proc.stderr, proc.stderr


def test_a_hold_is_written_under_a_name_no_other_process_shares(tmp_path):
    """A process of the same host name and pid (another container) writing its own hold beside this one keeps its
    half-written file: the names written before the link differ."""
    from mtp_train.lock import _create

    lock = tmp_path / ".lock.rank-00000"
    theirs = tmp_path / f".{lock.name}.{socket.gethostname()}.{os.getpid()}"
    theirs.write_text('{"pid": 1')
    assert _create(lock, {"pid": os.getpid()})
    assert json.loads(lock.read_text()) == {"pid": os.getpid()}
    assert theirs.read_text() == '{"pid": 1', "another process's file was overwritten or removed"


def test_two_processes_taking_over_one_stale_hold_never_remove_each_others(tmp_path, monkeypatch):
    """This process and another both judge one stale hold gone. The other starts its takeover while this one is in
    the middle of its own (between reading the stale hold and removing it), and the takeover's marker looks older than
    any takeover takes (a stall, or a file server's clock ahead). One of the two holds the lock in the end, never
    both: the other does not take over while this one is, and this one does not remove a fresh hold."""
    import time

    from mtp_train import lock as lock_module
    from mtp_train.errors import UserError

    lock = tmp_path / ".lock.rank-00000"
    stale = _lock_record()
    lock.write_text(stale)
    other: list[subprocess.Popen] = []
    code = ("import sys; from pathlib import Path; from mtp_train.errors import UserError\n"
            "from mtp_train.io import pause_point\nfrom mtp_train.lock import acquire\n"
            "try:\n    acquire(Path(sys.argv[1]), 'stage', timeout=3)\n"
            "except UserError as e:\n    print(f'mtp-train: {e}', file=sys.stderr); sys.exit(2)\n"
            "pause_point('hold', 0)\n")
    reads = []
    read = lock_module._read

    def race(path):
        holder = read(path)
        if path == lock and holder == json.loads(stale):
            reads.append(path)
            if len(reads) == 2:  # this process is taking over: it read the stale hold again under its marker
                aged = time.time() - 3600  # far past the 60 s after which the old code broke a marker
                for marker in tmp_path.glob(f"{lock.name}.takeover*"):
                    os.utime(marker, (aged, aged))
                other.append(subprocess.Popen([sys.executable, "-c", code, str(lock)], cwd=REPO, text=True,
                                              env=pause_env("hold", 0, tmp_path / "paused"),
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE))
                deadline = time.monotonic() + 120
                while other[0].poll() is None and not list((tmp_path / "paused").iterdir()):
                    assert time.monotonic() < deadline, "the other process neither took the lock nor gave up"
                    time.sleep(0.05)
        return holder

    monkeypatch.setattr(lock_module, "_read", race)
    try:
        try:
            mine = lock_module.acquire(lock, "stage")
        except UserError:
            mine = None
        assert len(other) == 1
        paused = list((tmp_path / "paused").iterdir())
        if paused:  # the other took the lock too: it must be the only holder
            assert mine is None and json.loads(lock.read_text())["pid"] == other[0].pid, \
                "both processes hold the lock: this one removed the other's fresh hold"
        else:
            _, err = other[0].communicate(timeout=60)
            assert other[0].returncode == 2, err
            (line,) = err.strip().splitlines()
            assert f"pid {os.getpid()} on {socket.gethostname()}" in line, line
            assert mine is not None and read(lock) == mine
    finally:
        for proc in other:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lock_module.release(lock, mine)
    assert not list(tmp_path.glob(".lock*")), "no hold or marker is left behind"


def test_a_hold_that_keeps_vanishing_is_retried_with_pauses_and_given_up_in_one_line(tmp_path):
    """The link fails on an existing name that is gone when read, again and again: the tries pause between them and
    end, at the deadline, in one line saying what to do (not a busy loop without end)."""
    lock = tmp_path / ".lock.rank-00000"
    code = ("import sys; from pathlib import Path; from mtp_train import lock; from mtp_train.errors import UserError\n"
            "tries = []\nlock._create = lambda path, record: tries.append(path) and False\n"
            "try:\n    lock.acquire(Path(sys.argv[1]), 'stage', timeout=1)\n"
            "except UserError as e:\n    print(f'mtp-train: {e}', file=sys.stderr); print(len(tries)); sys.exit(2)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(lock)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("a hold that keeps vanishing is retried without end")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"mtp-train: stage: {lock}") and "1 s" in line, line
    assert 2 <= int(proc.stdout) <= 100, f"{proc.stdout.strip()} tries in 1 s"


def test_a_directory_member_of_another_job_refuses_only_while_it_may_live(tmp_path):
    """Injected members of the directory hold: one of another world size whose process on this machine is gone is
    removed and the run goes on; one on another machine refuses in one line saying what to delete if it is gone, and
    the refused run leaves nothing; a member of the same job is joined."""
    from mtp_train.errors import UserError
    from mtp_train.lock import shared

    hold = tmp_path / "features" / ".lock.dir"
    hold.parent.mkdir()
    one, two = ({"world_size": w, "fingerprint": "f"} for w in (1, 2))

    def member(name: str, **fields) -> Path:
        path = hold.with_name(f"{hold.name}.{name}")
        path.write_text(json.dumps({**json.loads(_lock_record(**fields)), "key": one,
                                    "label": "a precompute of world size 1"}))
        return path

    gone = member("00000000000000aa")
    with shared(hold, "precompute rank 1", two, "a precompute of world size 2"):
        assert not gone.exists() and len(list(hold.parent.glob(".lock.dir.*"))) == 1
    assert not list(hold.parent.iterdir())
    elsewhere = member("00000000000000bb", host="node-17", pid=4242)
    with pytest.raises(UserError) as refused:
        with shared(hold, "precompute rank 1", two, "a precompute of world size 2"):
            pytest.fail("ran beside a live member of another world size")
    assert "is being written by pid 4242 on node-17" in str(refused.value) \
        and "world size 1" in str(refused.value) and f"if that job is gone, delete {elsewhere}" in str(refused.value)
    assert list(hold.parent.iterdir()) == [elsewhere]
    with shared(hold, "precompute rank 1", one, "a precompute of world size 1"):
        assert len(list(hold.parent.iterdir())) == 2
    assert list(hold.parent.iterdir()) == [elsewhere]
