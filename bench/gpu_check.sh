#!/usr/bin/env bash
# bench/gpu_check.py on the device tool's GPU machine, from a fresh checkout (no network there).
#
#   bash bench/gpu_check.sh fetch   here, with network: download the wheels that machine lacks into .whl/ (~18 MB,
#                                   for its Python 3.12, x86-64), build FlashInfer's kernels for sm_90a into .whl/aot/
#                                   (bench/flashinfer_aot.py: nvcc here), and git-ignore the folder
#   bash bench/gpu_check.sh [ARGS]  there: install the wheels of the modules it lacks to /tmp/site, the prebuilt
#                                   kernels into flashinfer's data/aot, the project with `pip install -e . --no-deps`,
#                                   then `python3 bench/gpu_check.py ARGS`
#
# Device tool: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540). What the check prints also goes
# to $OUT/gpu_check.out when $OUT is set (the check itself writes $OUT/gpu_check.md and $OUT/gpu_check.log).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# module=wheel pairs: flashinfer (the `gpu` extra) and what the image lacks of the project's own dependencies.
# The versions are those tested on CPU here; flashinfer 0.6.6 is the newest wheel that is small enough to carry.
WHEELS="flashinfer=flashinfer_python==0.6.6 tvm_ffi=apache_tvm_ffi==0.1.15.post2 pydantic=pydantic==2.14.4
pydantic_core=pydantic_core==2.50.5 annotated_types=annotated_types==0.8.0 typing_inspection=typing_inspection==0.4.5
datasets=datasets==5.2.0 dill=dill==0.4.1 multiprocess=multiprocess==0.70.19 hjson=hjson==3.1.0
cpuinfo=py_cpuinfo==9.0.0 msgpack=msgpack==1.2.4 einops=einops==0.8.2 ninja=ninja==1.13.2 psutil=psutil==7.2.2"
# DeepSpeed (train:deepspeed) has no wheel on the index: `fetch` builds a pure-Python one (no ops compiled) here.
DEEPSPEED=deepspeed==0.19.8

if [ "${1:-}" = fetch ]; then
    specs=$(for pair in $WHEELS; do echo "${pair#*=}"; done)
    # shellcheck disable=SC2086  # one argument per spec
    $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $specs || exit 1
    DS_BUILD_OPS=0 "${BUILD_PY:-.venv/bin/python}" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$DEEPSPEED" \
        || exit 1  # its setup imports torch: the project venv has it
    "${BUILD_PY:-.venv/bin/python}" bench/flashinfer_aot.py || exit 1
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    du -sh .whl
    exit 0
fi

missing=()
for pair in $WHEELS deepspeed=$DEEPSPEED; do
    module=${pair%%=*} spec=${pair#*=}
    if ! $PY -c "import $module" 2>/dev/null; then
        wheel=$(ls .whl/"${spec%%==*}"-"${spec#*==}"-*.whl 2>/dev/null | head -1)
        if [ -n "$wheel" ]; then missing+=("$wheel"); else echo "gpu_check.sh: no module $module and no wheel for it in .whl/"; fi
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check.sh: installing ${missing[*]} to /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${missing[@]}" \
        || echo "gpu_check.sh: the wheels did not install"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# FlashInfer's prebuilt kernels (bench/flashinfer_aot.py) where it looks for them first: its data/aot folder.
if [ -d .whl/aot ]; then
    aot=$($PY -c "from flashinfer.jit import env; print(env.FLASHINFER_AOT_DIR)" 2>/dev/null)
    if [ -n "$aot" ] && mkdir -p "$aot" && cp -r .whl/aot/. "$aot"/; then
        echo "gpu_check.sh: prebuilt FlashInfer kernels in $aot: $(ls .whl/aot | grep -vc BUILD.json) module(s)"
    else
        echo "gpu_check.sh: the prebuilt FlashInfer kernels could not be installed; flashinfer will compile them"
    fi
fi
# The project: bench/gpu_check.py finds it without an install too (it puts the checkout on the path).
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "gpu_check.sh: pip install -e . failed; the checkout is used from its path"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}  # flashinfer's JIT compiles with this many jobs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

if [ -n "${OUT:-}" ]; then
    $PY -u bench/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.out"
else
    $PY -u bench/gpu_check.py "$@"
fi
