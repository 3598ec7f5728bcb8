#!/usr/bin/env bash
# Device validation of the GPU engine (issue 4), on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [RESULTS_DIR]          run the checks (RESULTS_DIR: $OUT if set, else ./gpu-results)
#   scripts/gpu_check.sh --fetch-wheels [DIR]   on a networked machine: download the wheels an offline
#                                               GPU machine lacks into DIR (default ./wheels), to carry there
#
# Steps (each PASS/FAIL goes to summary.txt; everything is tee'd to gpu_check.log):
#   1. environment: nvidia-smi, nvcc, python and package versions      -> env.txt
#   2. install from this repo: pip install -e ".[test,gpu-cuda12|13]" (CUDA major from nvcc, capped
#      by the driver's, from nvidia-smi). A CuPy that already works is kept (never a second CuPy
#      wheel: two conflict). Offline: carried wheels ($WHEELHOUSE, default ./wheels) then a
#      --no-deps editable install over the preinstalled packages, then a PYTHONPATH shim.
#   3. trial launch: blendmatch.gpu.cupy_engine.gpu_unavailable_reason() must be None
#   4. pytest -m gpu with BLENDMATCH_REQUIRE_GPU=1 (a missing GPU fails, never skips) -> pytest-gpu.xml
#   5. device micro-benchmark, fused and array kernels, candidates checked bit for bit against the
#      CPU engine; target: >= 5e9 windows/s for hash+probe+compaction         -> bench_gpu.json
#   6. the service benchmark in GPU mode (upload_s / kernels_s / copyback_s splits) -> bench_service_gpu.json
# Exit status: 0 only when every step passed.
#
# Knobs (environment): PYTHON (python3), CUDA_MAJOR (12|13, skips detection), SKIP_INSTALL=1,
# WHEELHOUSE, BENCH_CHUNKS (1000000), BENCH_ITERS (20), GPU_KERNELS (fused,array), STEP_TIMEOUT (600 s).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# ----------------------------------------------------------------------------------------------
if [[ "${1:-}" == "--fetch-wheels" ]]; then
    dest="${2:-$REPO/wheels}"
    mkdir -p "$dest"
    pyver="${WHEEL_PYTHON_VERSION:-3.12}"
    # runtime and test dependencies missing from the lent GPU image (see .library device notes);
    # binary wheels only, for the GPU machine's Python, resolved with their dependencies
    "$PY" -m pip download --only-binary=:all: --python-version "$pyver" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dest" pydantic fastapi uvicorn nbclient nbformat ipykernel
    echo "wheels in $dest; carry them to the GPU machine (WHEELHOUSE=$dest)"
    exit 0
fi

RES="${1:-${OUT:-$REPO/gpu-results}}"
mkdir -p "$RES"
RES="$(cd "$RES" && pwd)"
LOG="$RES/gpu_check.log"
SUMMARY="$RES/summary.txt"
: >"$SUMMARY"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

STEP_TIMEOUT="${STEP_TIMEOUT:-600}"
FAILED=0

step() {  # step NAME CMD...: run, time and record PASS/FAIL without stopping the script
    local name="$1"; shift
    local t0=$SECONDS rc=0
    echo
    echo "=== [$name] $(date -u +%H:%M:%S) $*"
    "$@" || rc=$?
    if [[ $rc -eq 0 ]]; then
        echo "PASS $name ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
    else
        echo "FAIL $name (exit $rc, $((SECONDS - t0)) s)" | tee -a "$SUMMARY"
        FAILED=1
    fi
    return 0
}

# ---------------------------------------------------------------------------------------- 1. env
environment() {
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
        echo "python: $PY ($("$PY" --version 2>&1))"
        echo "--- nvidia-smi"
        nvidia-smi 2>&1 || echo "(nvidia-smi failed or missing)"
        echo "--- nvcc"
        nvcc --version 2>&1 || echo "(no nvcc)"
        echo "--- packages"
        "$PY" -m pip list 2>/dev/null | grep -i -E '^(numpy|numba|cupy|cupy-cuda|pydantic|fastapi|pytest|hypothesis|blendmatch) ' || true
    } | tee "$RES/env.txt"
}

cuda_major() {  # the CuPy wheel family to install: nvcc's CUDA major, capped by the driver's
    if [[ -n "${CUDA_MAJOR:-}" ]]; then echo "$CUDA_MAJOR"; return; fi
    local tk="" drv=""
    if command -v nvcc >/dev/null 2>&1; then
        tk="$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p' | head -n1)"
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        drv="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n1)"
    fi
    if [[ -n "$tk" && -n "$drv" ]]; then
        echo $(( tk < drv ? tk : drv ))
    elif [[ -n "$tk$drv" ]]; then
        echo "$tk$drv"
    else
        echo ""
    fi
}

cupy_works() {
    "$PY" - <<'EOF' >/dev/null 2>&1
import cupy
assert int((cupy.arange(8) ** 2).sum()) == 140
EOF
}

index_reachable() {  # a quick look before pip spends minutes retrying an unreachable index
    "$PY" - <<'EOF' >/dev/null 2>&1
import os, socket, urllib.parse
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
u = urllib.parse.urlparse(url)
socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=4).close()
EOF
}

deps_import() {
    "$PY" -c "import numpy, numba, pytest, pydantic" >/dev/null 2>&1
}

make_shim() {  # last resort: the package-dir layout (blendmatch.index -> index/ ...) via symlinks
    local shim="$RES/.shim"
    rm -rf "$shim" && mkdir -p "$shim/blendmatch"
    for f in "$REPO"/top/*; do ln -s "$f" "$shim/blendmatch/$(basename "$f")"; done
    for sub in bench index gpu service; do ln -s "$REPO/$sub" "$shim/blendmatch/$sub"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    echo "using a PYTHONPATH shim at $shim"
}

# ------------------------------------------------------------------------------------ 2. install
install() {
    if [[ "${SKIP_INSTALL:-0}" == "1" ]]; then echo "SKIP_INSTALL=1: using the environment as is"; return 0; fi
    local major extras="test"
    major="$(cuda_major)"
    echo "CUDA major for CuPy: ${major:-unknown}"
    if cupy_works; then
        echo "a working CuPy is installed already: keeping it"
    else
        case "$major" in
            12) extras="test,gpu-cuda12" ;;
            13|14|15) extras="test,gpu-cuda13" ;;
            *) echo "cannot tell the CUDA version (nvcc/nvidia-smi); set CUDA_MAJOR=12 or 13"; return 1 ;;
        esac
    fi
    local wh="${WHEELHOUSE:-$REPO/wheels}"
    if [[ -d "$wh" ]] && compgen -G "$wh/*.whl" >/dev/null; then
        echo "installing carried wheels from $wh"
        "$PY" -m pip install --no-index --find-links "$wh" "$wh"/*.whl || echo "(some carried wheels did not install)"
    fi
    if index_reachable; then
        if "$PY" -m pip install --retries 2 --timeout 30 -e ".[${extras}]"; then return 0; fi
        echo "pip install -e .[${extras}] failed; trying without dependencies"
    else
        echo "no package index reachable: installing without dependencies"
        if [[ "$extras" == *gpu-cuda* ]]; then
            echo "CuPy is missing and cannot be downloaded here; carry a cupy-cuda${major}x wheel in $wh"
            return 1
        fi
    fi
    if ! "$PY" -m pip install --no-deps --no-build-isolation -e .; then
        make_shim
    fi
    if ! deps_import; then
        echo "missing Python packages (need numpy, numba, pytest, pydantic): carry wheels, see --fetch-wheels"
        return 1
    fi
}

# ------------------------------------------------------------------------------------- 3. trial
trial() {
    "$PY" - <<'EOF'
import sys
from blendmatch.gpu.cupy_engine import gpu_unavailable_reason
from blendmatch.gpu.select import create_gpu_engine
why = gpu_unavailable_reason()
if why:
    print("GPU unavailable:", why)
    sys.exit(1)
for kernels in ("fused", "array"):
    eng = create_gpu_engine(reason="gpu_check", kernels=kernels)  # compiles + self-test
    print(f"trial launch + self-test OK: kernels={kernels} on {eng.device_name}")
    eng.close()
EOF
}

# ------------------------------------------------------------------------------------- 4. tests
gpu_tests() {
    # only the files that hold gpu-marked tests (the engine fixture or an explicit mark), so a
    # service test module whose optional dependencies are absent cannot break collection
    local files
    files="$(grep -l -E 'pytest\.mark\.gpu|def test_[A-Za-z0-9_]+\([^)]*\bengine\b' tests/test_*.py | tr '\n' ' ')"
    [[ -n "$files" ]] || files="tests"
    echo "test files: $files"
    # shellcheck disable=SC2086
    BLENDMATCH_REQUIRE_GPU=1 timeout "$STEP_TIMEOUT" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        --tb=short --maxfail=20 --junitxml="$RES/pytest-gpu.xml" $files
}

# ------------------------------------------------------------------------------------- 5. bench
micro_bench() {
    timeout "$STEP_TIMEOUT" "$PY" -m blendmatch.bench.gpu_micro --chunks "${BENCH_CHUNKS:-1000000}" \
        --queries 64 --tokens 32768 --window 256 --stride 1 --iters "${BENCH_ITERS:-20}" \
        --kernels "${GPU_KERNELS:-fused,array}" --check cpu --out "$RES"
    "$PY" - "$RES/bench_gpu.json" <<'EOF'
import json, sys
rep = json.load(open(sys.argv[1]))
ok = True
for r in rep["results"]:
    rate = r["kernel_windows_per_s"] or 0
    print(f"{r['kernels']}: {rate / 1e9:.2f} G windows/s (hash+probe+compaction), target 5.00; "
          f"matches CPU engine: {r['matches_check']}")
    ok &= bool(r["matches_check"])
best = max((r["kernel_windows_per_s"] or 0) for r in rep["results"])
print("target met" if best >= 5e9 else "TARGET MISSED (< 5e9 windows/s)")
sys.exit(0 if ok and best >= 5e9 else 1)
EOF
}

service_bench() {
    local args=(--engine gpu --chunks "${BENCH_CHUNKS:-1000000}" --query-tokens 32768 --batch-queries 1,16,64
                --hit-fractions 0,0.25 --repeat 3 --json "$RES/bench_service_gpu.json")
    # bench/ imports only gpu and index (no FastAPI), so it runs without the service's extras
    timeout "$STEP_TIMEOUT" "$PY" -m blendmatch.bench.engine "${args[@]}"
}

# ------------------------------------------------------------------------------------------ run
echo "gpu_check: results in $RES"
step environment environment
step install install
step trial trial
if grep -q '^FAIL trial' "$SUMMARY"; then
    # no usable GPU engine: the device steps below would only repeat the trial's failure
    for s in gpu-tests micro-bench service-bench; do echo "FAIL $s (not run: the trial launch failed)" | tee -a "$SUMMARY"; done
    FAILED=1
else
    step gpu-tests gpu_tests
    step micro-bench micro_bench
    step service-bench service_bench
fi

echo
echo "=== summary"
cat "$SUMMARY"
exec 1>&- 2>&-                      # let tee drain the log before the results are collected
wait "$TEE_PID" 2>/dev/null || true
exit "$FAILED"
