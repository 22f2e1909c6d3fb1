"""The runtime's CPU kernels, built on first use into one library, or ``None`` where they cannot be:

- the small-row matmul (``small_rows.cpp``) multiplies a few rows by a weight packed once (``pack``; in bfloat16
  where the weight's values all are bfloat16), reading the weight from memory once for all rows;
  ``runtime/small_batch.py`` measures where it beats BLAS and gives those weights a packed copy;
- the paged attention of a decode or verify step (``paged_attention.cpp``, ``attend``): rotary embedding, the
  cache writes and every query's softmax over its pages in one call (``attend_paged``: the softmax alone, for a
  step of many rows whose projections run on BLAS);
- a whole decoder layer of such a step in one call (``decode_layer.cpp``, ``decode_layer``): the norms, the packed
  projections, that attention and the gated MLP (``runtime/attention.py``'s plan runs the layers so).

The library is compiled with
``torch.utils.cpp_extension`` (g++ and ninja, both installed with the project's environment) for this machine
(``-march=native``, ``-fopenmp`` for torch's threads) into ``$XDG_CACHE_HOME/mtp-train/`` (``~/.cache`` by default;
``MTP_TRAIN_KERNEL_DIR`` overrides it), keyed by the sources, the flags, torch's version, the CPU's model and
instruction-set flags (/proc/cpuinfo's, not torch's capability label: a home directory shared by two CPU
generations must not hand one's build to the other) and the compiler (its path and ``--version``), so a build is
reused and never loaded on a machine it was not built for; a build is finished in a scratch directory and then
renamed into place, so no process ever waits on another's lock (see ``library``). Where the build fails (no
compiler, say), one warning names the reason and the engine runs on BLAS alone; the failure is remembered for that
key in a marker file beside the build directory (``failure_marker``), so that later processes do not compile again
to fail again: they warn once, naming the marker, which is deleted to retry.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from mtp_train.io import write_atomic

SOURCES = tuple(Path(__file__).with_name(name) for name in ("small_rows.cpp", "paged_attention.cpp", "decode_layer.cpp"))
HEADER = Path(__file__).with_name("kernels.h")
MAX_ROWS = 64  # rows up to which the runtime multiplies on the kernel (decodes at batch <= 64, verifies of a few)
LIBRARY = "mtp_small_rows.so"
BUILD_TIMEOUT_S = 600
# -fopenmp (compiling and linking): torch's CPU builds run at::parallel_for on OpenMP, inline in its headers, so
# without it the kernel runs on one thread; the library links libgomp.so.1, which resolves to the one torch loaded.
FLAGS = ("-O3", "-march=native", "-fopenmp")
log = logging.getLogger(__name__)

# Compiled in a child process so that the build has a time limit and this process loads the finished library once.
_BUILD = """
import sys
from torch.utils.cpp_extension import load
load(name="mtp_small_rows", sources=sys.argv[1].split(","), build_directory=sys.argv[2], is_python_module=False,
     extra_cflags=sys.argv[3].split(), extra_ldflags=["-fopenmp"], verbose=False)
"""


def build_dir() -> Path:
    if override := os.environ.get("MTP_TRAIN_KERNEL_DIR"):
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp-train"


def _reason(output: str) -> str:
    """The line of a failed build's output that says why: the first compiler error or missing program, else the
    last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line or "not found" in line), lines[-1] if lines else "")


def library(where: Path) -> Path:
    """The built kernel in ``where``, compiling it first if ``where`` holds none.

    A build happens in a scratch directory beside ``where`` that is renamed to ``where`` only once it is complete,
    so ``where`` holds a finished library or nothing, and loading one takes no lock: a process killed while it built
    or loaded (torch's own builder leaves a ``lock`` file then, which blocks every later build in that directory)
    never holds up the next one. Scratch directories an hour old are a killed build's and are removed.
    """
    if (where / LIBRARY).is_file():
        return where / LIBRARY
    where.parent.mkdir(parents=True, exist_ok=True)
    for stale in where.parent.glob(f"{where.name}.build-*"):
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{where.name}.build-", dir=where.parent))
    log.info("building the CPU kernels in %s (about a minute, once per CPU and compiler)", where)
    try:
        done = subprocess.run([sys.executable, "-c", _BUILD, ",".join(map(str, SOURCES)), str(scratch), " ".join(FLAGS)],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(_reason(done.stderr or done.stdout) or f"the build exited with status {done.returncode}")
        (scratch / "lock").unlink(missing_ok=True)
        scratch.chmod(0o755)  # mkdtemp's is 0o700
        if where.exists() and not (where / LIBRARY).is_file():
            shutil.rmtree(where)  # an unfinished directory an older version of this module left
        try:
            scratch.rename(where)
        except OSError:  # another process finished the same build first: its library is as good
            if not (where / LIBRARY).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return where / LIBRARY


def cpu_identity(cpuinfo: str | None = None) -> str:
    """What ``-march=native`` compiles for: the first processor's model and instruction-set flags in ``cpuinfo``
    (/proc/cpuinfo's text by default), or the platform's machine and processor names where it has neither."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    found: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features") and key not in found:
            found[key] = " ".join(value.split())
    if not found:
        return f"{platform.machine()} {platform.processor()}"
    return "; ".join(f"{key}: {value}" for key, value in sorted(found.items()))


def compiler_identity(cxx: str | None = None) -> str:
    """The C++ compiler torch's builder runs (``cxx``; by default ``CXX``, else ``c++``, as torch chooses): its path
    and the first line of its ``--version``, or its name and "not found"."""
    cxx = cxx if cxx is not None else os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx} not found"
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        version = (done.stdout or done.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as err:
        version = f"no version ({type(err).__name__})"
    return f"{path} {version}"


def kernel_dir(cpuinfo: str | None = None, compiler: str | None = None) -> Path:
    """Where the build of these sources, flags and torch version by this compiler for this CPU lives (or will):
    ``cpuinfo`` (/proc/cpuinfo's text) and ``compiler`` (``compiler_identity``'s line) are this machine's by
    default."""
    cpu = cpu_identity(cpuinfo)
    compiler = compiler if compiler is not None else compiler_identity()
    # "scratch-then-rename" keeps apart the directories torch's builder wrote in place before ``library`` existed
    sources = b"".join(p.read_bytes() for p in (*SOURCES, HEADER))
    key = hashlib.sha256(sources + f"{torch.__version__} {platform.machine()} {cpu} {compiler} {' '.join(FLAGS)} "
                         "scratch-then-rename".encode()).hexdigest()[:12]
    return build_dir() / f"small_rows-{key}"


def failure_marker(where: Path) -> Path:
    """The file that remembers a failed build of ``where`` (it holds the reason); deleting it makes the next
    process try again."""
    return where.with_name(f"{where.name}.failed")


def _remember_failure(marker: Path, reason: str) -> None:
    """Write ``reason`` to ``marker`` whole or not at all; a cache directory that cannot be written to only means
    the next process tries again."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, reason + "\n")
    except OSError:
        pass


@cache
def kernel() -> object | None:
    """The loaded matmul ops (``kernel().pack``, ``kernel().linear``; ``attend`` is loaded with them), or ``None``
    where the library cannot be built."""
    where = kernel_dir()
    marker = failure_marker(where)
    try:
        reason = marker.read_text().strip()  # failed before for this key: compiling again would fail again, slowly
    except OSError:
        reason = None
    if reason is not None:
        log.warning("CPU small-row kernel not built: its build failed before for this CPU and compiler (%s); decode "
                    "runs on BLAS alone (delete %s to retry)", reason, marker)
        return None
    try:
        torch.ops.load_library(str(library(where)))
    except Exception as err:  # a missing compiler or ninja, or a build past its time: BLAS alone runs everything
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        _remember_failure(marker, reason)
        log.warning("CPU small-row kernel not built in %s (%s); decode runs on BLAS alone, and later processes "
                    "will not retry until %s is deleted", where, reason, marker)
        return None
    return torch.ops.mtp_small_rows


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor, page_start: torch.Tensor,
           pages: torch.Tensor, n_heads: int, n_kv_heads: int, scale: float, window: int = 0) -> torch.Tensor:
    """One layer's attention of a decode or verify step (``paged_attention.cpp`` gives the shapes): ``qkv [T, (Hq +
    2 Hkv) D]`` float32 -> ``[T, Hq D]``, the rotated keys and the values stored at ``slots`` on the way; a
    ``window`` > 0: each query sees its last ``window`` keys."""
    kernel()  # loads the library on first use
    return torch.ops.mtp_paged_attention.attend(qkv, cos, sin, k_cache, v_cache, slots, q_start, kv_lens, page_start,
                                                pages, n_heads, n_kv_heads, scale, window)


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                 kv_lens: torch.Tensor, page_start: torch.Tensor, pages: torch.Tensor, scale: float, window: int = 0
                 ) -> torch.Tensor:
    """``attend``'s softmax over the pages for queries ``q [T, Hq, D]`` float32 already rotated, whose keys and values
    are already in the cache -> ``[T, Hq D]``."""
    kernel()
    return torch.ops.mtp_paged_attention.attend_paged(q.contiguous(), k_cache, v_cache, q_start, kv_lens, page_start,
                                                      pages, scale, window)


@dataclass(frozen=True)
class LayerWeights:
    """A decoder layer as ``decode_layer`` takes it: its norms' weights ``[H]`` (no attention norm for an EAGLE
    layer; Gemma's with their offset added), its projections packed (``pack``), the q/k/v bias (or None), its
    attention's sizes; the q/k norms ``[D]``, the norms after attention and MLP (Gemma's), the GELU and the sliding
    window (0: none) where the layer has them."""

    attention_norm: torch.Tensor | None
    wqkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    gelu: bool = False
    window: int = 0


def decode_layer(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                 page_start: torch.Tensor, pages: torch.Tensor, window: int = 0,
                 attention_input: torch.Tensor | None = None) -> torch.Tensor:
    """A decoder layer over ``x [T, H]`` float32 (a few rows) in one call -> ``[T, H]``; the attention's
    arguments as ``attend`` takes them (``window``: the step's sliding window, where the layer has none of its own:
    a Mistral target's, a draft head's; ``attention_input [T, 2H]``: an EAGLE-3 layer's normed input, ``x`` its
    residual)."""
    return torch.ops.mtp_decode_layer.decode_layer(
        x, w.attention_norm, w.wqkv, w.qkv_bias, w.wo, w.ffn_norm, w.w_gate_up, w.w_down, w.eps, cos, sin, k_cache,
        v_cache, slots, q_start, kv_lens, page_start, pages, w.num_heads, w.num_kv_heads, w.scale, w.q_norm, w.k_norm,
        w.post_attention_norm, w.post_ffn_norm, w.gelu, w.window or window, attention_input)


def exactly_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 ``weight`` is a bfloat16 (a checkpoint stored in bf16), so that a bf16
    copy of it loses nothing."""
    return bool(torch.equal(weight, weight.to(torch.bfloat16).to(weight.dtype)))


def pack(weight: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """``weight [N, K]`` float32 -> its packed copy ``[ceil(N / 32), K, 32]`` for ``linear``: float32, or bfloat16
    with ``bf16`` (half the bytes to read; only for a weight that is ``exactly_bf16``, where ``linear``'s products
    are then the float32 copy's bit for bit)."""
    return kernel().pack(weight, bf16)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K]`` times the packed weight -> ``[M, out_features]`` (the weight read once; compute-bound past a few
    rows, where BLAS takes over: ``small_batch.tune`` measures where)."""
    return kernel().linear(x.contiguous(), packed, out_features)


if __name__ == "__main__":  # `make venv` builds it once, so that the first engine does not wait for g++
    print(f"CPU kernels: {'built' if kernel() is not None else 'not built, BLAS and torch alone'} ({build_dir()})")
