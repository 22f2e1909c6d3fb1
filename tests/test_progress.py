"""Long stages say what they are doing: progress lines in logs, a bar on a terminal, the threads each stage takes,
and the warning when the machine is oversubscribed. The stages' own lines are checked through the CLI."""

from __future__ import annotations

import io
import re
import signal

import pytest

from conftest import REPO, run_cli
from mtp_train.errors import UserError
from mtp_train.progress import EVERY_ENV, Progress, duration, interval
from mtp_train.threads import (MAIN_THREAD_SIGNALS, default_threads, leave_signals_to_main_thread, load_warning,
                               local_processes, set_threads)
from precompute_helpers import make_recipe, sgd_rows, write_jsonl


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_say_done_of_total_tokens_per_second_and_eta_then_the_totals():
    out = io.StringIO()
    progress = Progress("train", 10, "steps", initial=2, every=0, stream=out)
    progress.update(1, tokens=4096, note="loss 3.210")
    progress.update(1, tokens=4096, note="loss 3.100")
    progress.close()
    progress.close()  # a second close prints nothing
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"train: 3/10 steps \(30\.0%\), loss 3\.210, 4,096 tokens, [\d,]+ tok/s, ETA \d+s", lines[0])
    assert lines[1].startswith("train: 4/10 steps (40.0%), loss 3.100, 8,192 tokens, ")
    assert re.fullmatch(r"train: 4/10 steps in \d+s, loss 3\.100, 8,192 tokens, [\d,]+ tok/s", lines[2])


def test_a_unit_of_tokens_is_not_counted_twice_and_nothing_done_has_no_eta():
    out = io.StringIO()
    progress = Progress("precompute", 3000, "tokens", every=0, stream=out)
    progress.update(0, note="shard 1/2")
    progress.update(1000, tokens=1000)
    progress.close()
    first, second, final = out.getvalue().splitlines()
    assert first == "precompute: 0/3,000 tokens (0.0%), shard 1/2, ETA unknown"
    assert re.fullmatch(r"precompute: 1,000/3,000 tokens \(33\.3%\), shard 1/2, [\d,]+ tok/s, ETA \d+s", second)
    assert re.fullmatch(r"precompute: 1,000/3,000 tokens in \d+s, shard 1/2, [\d,]+ tok/s", final)


def test_lines_come_at_the_interval_and_not_from_a_disabled_rank():
    out = io.StringIO()
    progress = Progress("regenerate", 100, "rows", every=3600, stream=out)
    for _ in range(50):
        progress.update(1, tokens=10)
    assert out.getvalue() == "", "nothing before the interval has passed"
    progress.close()
    assert out.getvalue().startswith("regenerate: 50/100 rows in ")
    quiet = io.StringIO()
    other = Progress("regenerate", 100, "rows", every=0, enabled=False, stream=quiet)
    other.update(5, tokens=10)
    other.close()
    assert quiet.getvalue() == ""


def test_a_terminal_gets_a_bar_and_the_same_final_line():
    term = Terminal()
    progress = Progress("eval: plain T=0", 4, "prompts", every=0, stream=term)
    progress.update(2, tokens=64)
    progress.close()
    text = term.getvalue()
    assert "\r" in text and "eval: plain T=0: 2/4 prompts (50.0%)" not in text, "a bar, not log lines"
    assert text.rstrip("\n").splitlines()[-1].startswith("eval: plain T=0: 2/4 prompts in ")


def test_summary_off_leaves_the_last_line_to_the_caller():
    out = io.StringIO()
    progress = Progress("eval: mtp k=2 T=0", 4, "prompts", every=0, summary=False, stream=out)
    progress.update(4, tokens=64)
    progress.close()
    assert len(out.getvalue().splitlines()) == 1 and " in " not in out.getvalue()


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(EVERY_ENV, raising=False)
    assert interval() == 30
    monkeypatch.setenv(EVERY_ENV, "0")
    assert interval() == 0
    monkeypatch.setenv(EVERY_ENV, "soon")
    with pytest.raises(UserError, match=EVERY_ENV):
        interval()


def test_duration():
    assert [duration(s) for s in (4.4, 59.6, 252, 7380)] == ["4s", "1m00s", "4m12s", "2h03m"]


# ---- threads ---------------------------------------------------------------------------------------------

def test_default_threads_share_the_cores_among_the_local_processes():
    assert local_processes({}) == 1
    assert local_processes({"WORLD_SIZE": "4"}) == 4
    assert local_processes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 8
    assert default_threads({}, cores=16) == 16
    assert default_threads({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, cores=16) == 4
    assert default_threads({"WORLD_SIZE": "3"}, cores=16) == 5
    assert default_threads({"LOCAL_WORLD_SIZE": "8"}, cores=2) == 1, "at least one"
    # A single process honours OMP_NUM_THREADS; a launcher's blanket OMP_NUM_THREADS=1 does not decide.
    assert default_threads({"OMP_NUM_THREADS": "3"}, cores=16) == 3
    assert default_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, cores=16) == 8


def test_set_threads_applies_the_recipe_value_or_the_default(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    try:
        assert set_threads(2) == 2 and torch.get_num_threads() == 2
        assert set_threads(None) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_loading_and_writing_threads_leave_stop_signals_to_the_main_thread():
    """A stop request sent while a run is stopped goes, on resuming, to the main thread (whose handler runs before
    the next check), never to a helper thread that may be scheduled after that check: the flake of SIGUSR1 read one
    step late. The trainer's prefetch pool, the read-ahead pool and the shard writer all start this way."""
    from concurrent.futures import ThreadPoolExecutor

    def blocked() -> set[int]:
        return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    with ThreadPoolExecutor(max_workers=1, initializer=leave_signals_to_main_thread) as pool:
        assert set(MAIN_THREAD_SIGNALS) <= pool.submit(blocked).result()
    with ThreadPoolExecutor(max_workers=1) as pool:  # a plain helper thread would take them
        assert not set(MAIN_THREAD_SIGNALS) & pool.submit(blocked).result()
    assert not set(MAIN_THREAD_SIGNALS) & blocked()
    sources = {name: (REPO / name).read_text() for name in
               ("mtp_train/train/trainer.py", "mtp_train/features/reader.py", "mtp_train/features/writer.py")}
    assert all("leave_signals_to_main_thread" in text for text in sources.values())


def test_oversubscription_is_one_warning_line():
    assert load_warning("train", load=1.9, cores=2) is None
    assert load_warning("train", load=2.0, cores=2) is None
    line = load_warning("train", load=3.25, cores=2)
    assert line is not None and len(line.splitlines()) == 1
    assert line.startswith("train: warning: ") and "3.2" in line and "2 core(s)" in line
    # The average remembers the stage before this one for a minute; with nothing else running now, no warning.
    assert load_warning("train", load=3.25, cores=2, others=0) is None
    assert load_warning("train", load=3.25, cores=2, others=2) is not None


# ---- the stages, run as a user would, into a log --------------------------------------------------------

def test_precompute_and_train_report_progress_into_a_log(tmp_path, monkeypatch):
    """stderr is a pipe here, as under nohup or SLURM: lines, not a bar, per batch of the target and per step."""
    from mtp_train.train.data import plan_batches
    from mtp_train.features.reader import FeatureReader

    monkeypatch.setenv(EVERY_ENV, "0")
    data = write_jsonl(tmp_path / "sgd.jsonl", sgd_rows(24, split="train"))
    recipe = make_recipe(tmp_path, data, data={"heldout_rows": 4},
                         precompute={"layers": [-1], "topk": 8, "shard_tokens": 3000, "batch_tokens": 512},
                         train={"batch_tokens": 1024, "max_steps": 4, "warmup_steps": 1, "val_every": 4,
                                "save_every": 4, "wandb_mode": "disabled"})
    proc = run_cli("precompute", recipe, "threads=1")
    assert proc.returncode == 0, proc.stderr
    total = re.search(r"24 rows, ([\d,]+) tokens", proc.stderr).group(1)
    shards = len(list((tmp_path / "run" / "features").glob("shard-*.safetensors")))
    lines = [x for x in proc.stderr.splitlines() if re.fullmatch(
        rf"precompute: [\d,]+/{total} tokens \(\d+\.\d%\), shard \d/{shards}, [\d,]+ tok/s, ETA \d+s", x)]
    assert len(lines) > shards, "a line per batch of the target, not per shard"
    assert re.search(rf"^precompute: {total}/{total} tokens in \d+s, shard {shards}/{shards}, [\d,]+ tok/s$",
                     proc.stderr, re.M), proc.stderr

    proc = run_cli("train", recipe, "threads=1")
    assert proc.returncode == 0, proc.stderr
    reader = FeatureReader(tmp_path / "run" / "features")
    per_epoch = len(plan_batches(reader.train, 1024, 0, 0))
    tokens = sum(r.stop - r.start for r in reader.train)
    assert (f"4 steps = {4 / per_epoch:.2f} epochs of {per_epoch} steps ({tokens:,} training tokens, at most 1,024 "
            "per step)") in proc.stderr, proc.stderr
    for step in range(1, 5):
        assert re.search(rf"^train: {step}/4 steps \({step / 4:.1%}\), loss [\d.]+, [\d,]+ tokens, [\d,]+ tok/s, "
                         r"ETA \d+s$", proc.stderr, re.M), proc.stderr
    assert re.search(r"^train: 4/4 steps in \d+s, loss [\d.]+, [\d,]+ tokens, [\d,]+ tok/s$", proc.stderr, re.M)
    assert "Setting accelerator to CPU" not in proc.stderr, "DeepSpeed is not the engine: no DeepSpeed warning"
