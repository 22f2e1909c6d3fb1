"""Which attention backend the runtime runs, decided without a GPU: the recipe's choice, the device, the dtype."""

from __future__ import annotations

import pytest
import torch

import mtp_train.runtime.attention as attention
from conftest import TINY_TARGET
from mtp_train.errors import UserError

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("name, device, dtype, latent, want", [
    ("auto", CPU, torch.float32, False, "torch"),
    ("auto", CUDA, torch.bfloat16, False, "flashinfer"),
    ("auto", CUDA, torch.float16, False, "flashinfer"),
    ("auto", CUDA, torch.float32, False, "torch"),  # flashinfer has no fp32 kernels
    ("flashinfer", CUDA, torch.bfloat16, False, "flashinfer"),
    ("flashinfer", CUDA, torch.float32, False, "torch"),  # falls back, with a notice, instead of failing
    ("torch", CUDA, torch.bfloat16, False, "torch"),
    ("auto", CUDA, torch.bfloat16, True, "torch"),  # MLA: only torch's paged latent attention
])
def test_backend_name(monkeypatch, capsys, name, device, dtype, latent, want):
    monkeypatch.setattr(attention, "_flashinfer_installed", lambda: True)
    monkeypatch.setattr(attention, "_noticed", set())
    assert attention.backend_name(name, device, dtype, "MLA (DeepSeek)" if latent else None) == want
    notice = capsys.readouterr().err
    assert ("no float32 kernels" in notice) == (name == "flashinfer" and want == "torch"), notice


@pytest.mark.parametrize("device, latent, message", [(CPU, False, "needs a CUDA device"),
                                                     (CUDA, True, "not wired for MLA")])
def test_flashinfer_where_it_cannot_run_is_a_user_error(device, latent, message):
    with pytest.raises(UserError, match=message):
        attention.backend_name("flashinfer", device, torch.bfloat16, "MLA (DeepSeek)" if latent else None)


def test_flashinfer_workspace_is_at_least_512_mib():
    from mtp_train.runtime.flashinfer_backend import WORKSPACE_BYTES  # imports no flashinfer until it is built

    assert WORKSPACE_BYTES >= 512 * 2**20


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_drafters_use_the_backend_the_recipe_chose(monkeypatch, backend):
    import mtp_train.runtime.drafters as drafters
    from mtp_train.runtime.bigram_drafter import BigramDrafter
    from mtp_train.runtime.engine import Engine

    engine = Engine.from_pretrained(TINY_TARGET, backend=backend, small_batch_layout=False)
    asked = []
    select = drafters.select_backend
    monkeypatch.setattr(drafters, "select_backend", lambda name, *a, **k: asked.append(name) or select(name, *a, **k))
    BigramDrafter(engine, torch.zeros(engine.cfg.vocab_size, dtype=torch.long))
    assert asked == [backend]


def test_runs_of_similar_length_bound_the_padding():
    lengths = [40, 1500, 45, 1400, 60, 3, 900, 200, 130]
    runs = attention._similar_lengths(list(range(len(lengths))), lengths)
    assert sorted(b for run in runs for b in run) == list(range(len(lengths)))
    for run in runs:
        assert run == sorted(run)
        assert max(lengths[b] for b in run) <= attention.RATIO * min(lengths[b] for b in run) + attention.SLACK
    assert len(runs) < len(lengths)  # short ones share a run


def test_large_host_tensors_come_from_the_heap_after_keep_freed_memory():
    """A 48 MiB tensor: with glibc's defaults it is a fresh ``mmap`` (unmapped again when freed, so the next one
    faults in every page anew); after ``keep_freed_memory`` it lies in the ``[heap]``, whose freed memory later
    tensors reuse. Fresh processes, so no other test's settings count."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from mtp_train.runtime.host_memory import keep_freed_memory\n"
            "assert sys.argv[1] == 'default' or (keep_freed_memory() and keep_freed_memory())\n"
            "x = torch.empty(12 * 2**20)\n"
            "heap = [line.split()[0].split('-') for line in open('/proc/self/maps') if line.rstrip().endswith('[heap]')]\n"
            "print(any(int(a, 16) <= x.data_ptr() < int(b, 16) for a, b in heap))\n")
    in_heap = {how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True,
                                   check=True).stdout.strip() for how in ("default", "kept")}
    assert in_heap == {"default": "False", "kept": "True"}
