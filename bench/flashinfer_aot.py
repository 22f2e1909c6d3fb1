"""FlashInfer's kernels for the GPU check, built here ahead of time, so that the GPU machine loads them at once.

flashinfer-python 0.6.6 compiles each kernel module with nvcc at its first use. This builds, on this CPU machine, the
modules the runtime plans at the GPU check's shapes (bf16, head dim 128, Hopper's sm_90a): the paged prefill module
``auto`` picks on Hopper (fa3: causal steps and DFlash's non-causal block), fa2's (tree masks) and the paged-append
module, each as flashinfer's own JIT would (its ninja files, against tvm-ffi's headers), and writes them where
flashinfer looks for prebuilt modules: ``.whl/aot/NAME/NAME.so``, which bench/gpu_check.sh copies into the
installed package's ``data/aot`` on the GPU machine. It needs nvcc here (CUDA 13.0's, at /usr/local/cuda) and the
network for four packages (``bash bench/gpu_check.sh fetch`` runs this after downloading the wheels).

What CUDA lacks here is made up in a temporary CUDA home: curand's headers (from the ``nvidia-curand`` wheel: the
cutlass utilities that fa3 includes name them), and a stub ``libcuda.so`` (soname ``libcuda.so.1``) to link against,
as CUDA's own ``lib64/stubs`` would give; the GPU machine's driver provides the real one.

    .venv/bin/python bench/flashinfer_aot.py [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".whl" / "aot"
CUDA = Path("/usr/local/cuda")
ARCH = "9.0a"  # H100, H200
HEAD_DIMS = (128,)  # the GPU check's random target and the 70B probe
CURAND = "nvidia-curand==10.4.5.25"  # CUDA 13's curand, for its headers
PACKAGES = ("flashinfer-python==0.6.6", "apache-tvm-ffi==0.1.15.post2", "nvidia-ml-py")

BUILD = r'''
import json, sys, time, torch
from flashinfer.jit.core import build_jit_specs
from flashinfer.jit.page import gen_page_module
from flashinfer.prefill import gen_batch_prefill_module
specs = [gen_page_module()]
for head_dim in json.loads(sys.argv[1]):
    args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, head_dim, head_dim, 0, False, False, False)
    specs += [gen_batch_prefill_module(backend, *args) for backend in ("fa3", "fa2")]
built = []
for spec in specs:
    start = time.perf_counter()
    build_jit_specs([spec], verbose=False, skip_prebuilt=False)
    built.append({"name": spec.name, "so": str(spec.jit_library_path), "seconds": round(time.perf_counter() - start)})
    print(f"  {spec.name}: {built[-1]['seconds']}s", flush=True)
print(json.dumps(built))
'''


def cuda_home(tmp: Path) -> Path:
    """A CUDA home of links to /usr/local/cuda, plus curand's headers and a stub libcuda.so."""
    home = tmp / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "lib64" / "stubs").mkdir(parents=True)
    for name in ("bin", "nvvm"):
        (home / name).symlink_to(CUDA / name)
    for f in (CUDA / "include").iterdir():
        (home / "include" / f.name).symlink_to(f)
    for f in (CUDA / "lib64").iterdir():
        (home / "lib64" / f.name).symlink_to(f)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp / "curand"), CURAND],
                   check=True)
    for f in (tmp / "curand" / "nvidia" / "cu13" / "include").iterdir():
        if not (home / "include" / f.name).exists():
            (home / "include" / f.name).symlink_to(f)
    (tmp / "stub.c").write_text("")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(home / "lib64" / "stubs" /
                                                                                   "libcuda.so"), str(tmp / "stub.c")],
                   check=True)
    return home


def site(tmp: Path) -> Path:
    """flashinfer and tvm-ffi at the versions the check carries (for this Python: the modules are built against
    tvm-ffi's C ABI alone) and pynvml, which flashinfer imports, in a folder."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp / "site"),
                    *PACKAGES], check=True)
    return tmp / "site"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="nvcc jobs at once (flashinfer's MAX_JOBS)")
    parser.add_argument("--force", action="store_true", help="build again when .whl/aot/ already holds these kernels")
    args = parser.parse_args(argv)
    if not args.force and _built():
        print(f"flashinfer_aot: {OUT.relative_to(ROOT)}/ already holds these kernels (--force builds them again)")
        return 0
    if not (CUDA / "bin" / "nvcc").is_file():
        print(f"flashinfer_aot: no nvcc at {CUDA / 'bin'}; nothing built", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="flashinfer-aot-") as name:
        tmp = Path(name)
        env = {**os.environ, "CUDA_HOME": str(cuda_home(tmp)), "PYTHONPATH": str(site(tmp)),
               "FLASHINFER_CUDA_ARCH_LIST": ARCH, "FLASHINFER_WORKSPACE_BASE": str(tmp), "MAX_JOBS": str(args.jobs)}
        print(f"flashinfer_aot: building for sm_{ARCH.replace('.', '')} with {args.jobs} nvcc job(s), head dims "
              f"{list(HEAD_DIMS)}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", BUILD, json.dumps(HEAD_DIMS)], env=env, stdout=subprocess.PIPE,
                              text=True)
        if proc.returncode:
            print("flashinfer_aot: the build failed (its output is above)", file=sys.stderr)
            return 1
        built = json.loads(proc.stdout.strip().splitlines()[-1])
        seconds = round(time.perf_counter() - start)
        shutil.rmtree(OUT, ignore_errors=True)
        for module in built:
            (OUT / module["name"]).mkdir(parents=True)
            shutil.copy(module["so"], OUT / module["name"] / f"{module['name']}.so")
            module["bytes"] = (OUT / module["name"] / f"{module['name']}.so").stat().st_size
            del module["so"]
    total = sum(m["bytes"] for m in built)
    record = {"flashinfer": "0.6.6", "arch": ARCH, "head_dims": list(HEAD_DIMS), "nvcc": _nvcc_version(),
              "jobs": args.jobs, "seconds": seconds, "bytes": total, "modules": built}
    (OUT / "BUILD.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"flashinfer_aot: {len(built)} modules, {total / 2**20:.1f} MiB, built in {seconds}s -> "
          f"{OUT.relative_to(ROOT)}/")
    return 0


def _built() -> bool:
    """Whether ``OUT`` holds a complete build of this flashinfer, arch and head dims."""
    try:
        record = json.loads((OUT / "BUILD.json").read_text())
    except (OSError, ValueError):
        return False
    return (record.get("flashinfer") == "0.6.6" and record.get("arch") == ARCH
            and record.get("head_dims") == list(HEAD_DIMS)
            and all((OUT / m["name"] / f"{m['name']}.so").is_file() for m in record.get("modules", [])))


def _nvcc_version() -> str:
    out = subprocess.run([str(CUDA / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out else "?"


if __name__ == "__main__":
    sys.exit(main())
