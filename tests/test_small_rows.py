"""The CPU kernels' build cache (``runtime/small_rows.py``): keyed by what ``-march=native`` and the compiler make of
the sources, a failed build remembered for that key, and the pure-torch path where no compiler is found."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mtp_train.runtime import small_rows

CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
model name\t: {model}
flags\t\t: {flags}

"""
SKYLAKE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512bw avx512vl"
BROADWELL = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma"


def cpuinfo(flags: str, model: str = "Intel(R) Xeon(R) CPU") -> str:
    """Two processors' worth of a /proc/cpuinfo with ``flags``."""
    return "".join(CPUINFO.format(n=n, model=model, flags=flags) for n in range(2))


def test_the_build_is_keyed_by_the_cpus_flags_and_the_compiler():
    """A library built with ``-march=native`` on one CPU generation must never load on another that shares the
    home directory: two flag sets under the same model name and capability label, another model, another compiler
    and a machine without /proc/cpuinfo each get their own directory; the same inputs the same one."""
    key = small_rows.kernel_dir
    gcc12, gcc13 = "/usr/bin/c++ c++ (GCC) 12.2.0", "/usr/bin/c++ c++ (GCC) 13.1.0"
    skylake = key(cpuinfo=cpuinfo(SKYLAKE), compiler=gcc12)
    assert key(cpuinfo=cpuinfo(SKYLAKE), compiler=gcc12) == skylake
    others = {key(cpuinfo=cpuinfo(BROADWELL), compiler=gcc12), key(cpuinfo=cpuinfo(SKYLAKE, "AMD EPYC"),
                                                                   compiler=gcc12),
              key(cpuinfo=cpuinfo(SKYLAKE), compiler=gcc13), key(cpuinfo="", compiler=gcc12)}
    assert len(others) == 4 and skylake not in others
    assert all(p.parent == small_rows.build_dir() and p.name.startswith("small_rows-") for p in {skylake, *others})


def test_the_compiler_is_named_by_its_path_and_version(tmp_path):
    """The compiler torch's builder runs (``CXX``, else ``c++``) is identified by where it is and what its
    ``--version`` says; one that is not there is named so (its key then differs from any real compiler's)."""
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'fake c++ 9.9'\n")
    fake.chmod(0o755)
    assert small_rows.compiler_identity(str(fake)) == f"{fake} fake c++ 9.9"
    missing = small_rows.compiler_identity(str(tmp_path / "absent"))
    assert "not found" in missing and str(tmp_path / "absent") in missing


def test_a_failed_build_is_remembered_for_its_key_until_its_marker_is_deleted(tmp_path, monkeypatch, caplog):
    """A build that failed once is not tried again by later processes for the same key (each try can cost
    minutes of compiling): a marker beside the build directory names the reason, and the one notice says how to
    retry (delete it). Another key (a new compiler or CPU) tries again, and so does the same key once the marker
    is gone."""
    attempts: list[Path] = []

    def failing(where: Path) -> Path:
        attempts.append(where)
        raise RuntimeError("/bin/sh: 1: c++: not found\nninja: build stopped: subcommand failed.")

    where = tmp_path / "small_rows-aaaa"
    monkeypatch.setattr(small_rows, "library", failing)
    monkeypatch.setattr(small_rows, "kernel_dir", lambda: where)
    small_rows.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=small_rows.__name__):
            assert small_rows.kernel() is None
            small_rows.kernel.cache_clear()  # as a later process
            assert small_rows.kernel() is None
        assert attempts == [where], "the failed build was tried again"
        marker = small_rows.failure_marker(where)
        assert marker.parent == tmp_path and marker.read_text().strip() == "/bin/sh: 1: c++: not found"
        assert sorted(p.name for p in tmp_path.iterdir()) == [marker.name], "a temporary file was left behind"
        notices = [r.getMessage() for r in caplog.records]
        assert len(notices) == 2 and "c++: not found" in notices[0] and str(marker) in notices[0]
        assert "c++: not found" in notices[1] and f"delete {marker} to retry" in notices[1]

        where = tmp_path / "small_rows-bbbb"  # another compiler or CPU
        small_rows.kernel.cache_clear()
        assert small_rows.kernel() is None and attempts[-1] == where
        where = tmp_path / "small_rows-aaaa"
        marker.unlink()
        small_rows.kernel.cache_clear()
        assert small_rows.kernel() is None and attempts == [where, tmp_path / "small_rows-bbbb", where]
    finally:
        small_rows.kernel.cache_clear()


_NO_COMPILER = """
import logging, sys
import torch
import torch.nn.functional as F
from torch import nn
from mtp_train.models.parts import Linear
from mtp_train.runtime import small_batch, small_rows

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stderr)
assert small_rows.kernel() is None and small_rows.kernel() is None
assert small_batch.copy_kind() == "transposed"
torch.manual_seed(0)
model = nn.Sequential(Linear(45, 77, bias=False), Linear(77, 33))
small_batch.tune(model)
with torch.no_grad():
    for rows in (1, 2, 3, 8, 64):
        x = torch.randn(rows, 45)
        want = F.linear(F.linear(x, model[0].weight), model[1].weight, model[1].bias)
        assert torch.allclose(model(x), want, atol=1e-5, rtol=1e-5), rows
print("fallback ok")
"""


def test_without_a_compiler_the_kernels_fall_back_once_and_later_processes_do_not_retry(tmp_path):
    """With no C++ compiler (``CXX`` names a missing one and none is on ``PATH``), a process gets the pure-torch
    path with the right products after one notice line and a failure marker; the next process reads the marker
    instead of building (no build line) and says how to retry; with the marker deleted the build is tried again."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if ninja := shutil.which("ninja"):  # so that the build gets as far as calling the compiler
        (bin_dir / "ninja").symlink_to(ninja)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "PATH": str(bin_dir),
           "MTP_TRAIN_KERNEL_DIR": str(tmp_path / "cache")}

    def run() -> tuple[list[str], list[str]]:
        done = subprocess.run([sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr
        lines = [line for line in done.stderr.splitlines() if small_rows.__name__ in line]
        return [line for line in lines if line.startswith("WARNING")], [line for line in lines if "building" in line]

    notices, builds = run()
    markers = list((tmp_path / "cache").glob("*.failed"))
    assert len(markers) == 1, "no failure marker was written"
    assert len(notices) == 1 and str(markers[0]) in notices[0] and len(builds) == 1, notices + builds
    reason = markers[0].read_text()

    notices, builds = run()
    assert builds == [], "a later process built again"
    assert len(notices) == 1 and f"delete {markers[0]} to retry" in notices[0]
    assert markers[0].read_text() == reason

    markers[0].unlink()
    notices, builds = run()
    assert len(notices) == 1 and len(builds) == 1 and markers[0].is_file()
