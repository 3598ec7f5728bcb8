#!/usr/bin/env bash
# The GPU kit (issue 27): one device run must be enough.
#
#   scripts/gpu_check.sh --prepare   here, with network: wheels the device image lacks -> .whl/
#                                    (CPython 3.12, manylinux x86_64, plus this project's own wheel),
#                                    an environment shaped like the device image for --dry-run, and
#                                    the exact device call to make
#   scripts/gpu_check.sh             on the GPU machine (offline): install from .whl/, trial, the
#                                    measurements (engine-bench, service-bench, notebook), gpu tests,
#                                    self-test at scale -> $OUT/summary.json with the targets judged
#   scripts/gpu_check.sh --dry-run   any CPU machine, offline after --prepare: the same install and
#                                    plumbing in the image-shaped environment; the measuring steps
#                                    run on the fake device (tests/fake_cupy.py, tiny sizes, figures
#                                    marked "fake", targets not judged); the other device steps skipped
#
# Results (OUT, default ./gpu-results): summary.json {"device", "dry_run", "date", "steps": [{"name",
# "status": ok|failed|skipped, "seconds"}], "figures": {...}, "targets": {...}}, gpu_check.log,
# env.txt, pytest-gpu.xml; copy summary.json and gpu_check.log to docs/gpu-runs/DATE/ (its README).
# Every step is bounded by `timeout`, all of them together by BUDGET_S (500 s: the device
# command's limit is 600 s, and the call below gives it 570).
# The measuring steps run before the gpu tests and the scale self-test, so a run cut short by
# the budget still has its figures. Exit status: 0 when no step failed. Knobs: PYTHON (python3),
# BUDGET_S, KIT_SITE, SKIP_STEPS (step names, space-separated: e.g. "gpu-tests scale-self-test"
# for a run that only measures).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WHL="$REPO/.whl"
# what the H200 image lacks (docs/performance.md, "GPU engine"); the image has numpy, numba,
# httpx, prometheus-client, pytest, hypothesis, uvloop, tqdm, anyio, h11, ... and CuPy 14 (click is
# there too, but the dry-run environment lacks it, so it is carried)
DEVICE_MISSING=(pydantic fastapi uvicorn httptools blake3 cbor2 pybase64)
IMAGE_HAS_RE='^(anyio|idna|sniffio|h11|typing_extensions|certifi|httpcore|httpx|packaging|uvloop|numpy)-'
# the image-shaped environment of --dry-run (kept outside the clone, reused between clones)
IMAGE_PACKAGES=(numpy numba httpx prometheus-client pytest hypothesis uvloop tqdm packaging)
IMAGE_ENV="${BLENDMATCH_IMAGE_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/blendmatch/gpu-image-py312}"
DEVICE_CALL='run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=570)'

find_py312() {
    local c
    for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    return 1
}

# -------------------------------------------------------------------------------------- prepare
if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    PY="${PYTHON:-python3}"
    rm -rf "$WHL" && mkdir -p "$WHL/deps"
    echo "== this project's wheel -> .whl/"
    "$PY" -m pip wheel -q --no-deps -w "$WHL" "$REPO"
    echo "== wheels the device image lacks (CPython 3.12, manylinux x86_64) -> .whl/deps/"
    "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHL/deps" "${DEVICE_MISSING[@]}"
    for f in "$WHL"/deps/*.whl; do  # keep only what the image lacks: two versions of one package break it
        if basename "$f" | grep -Eq "$IMAGE_HAS_RE"; then rm -f "$f"; fi
    done
    ls -1 "$WHL" "$WHL/deps"
    if [[ "${PREPARE_IMAGE:-1}" == "1" ]]; then
        echo "== the image-shaped environment for --dry-run: $IMAGE_ENV"
        py312="$(find_py312)" || { echo "no python3.12 here: --dry-run needs one (skip with PREPARE_IMAGE=0)"; exit 1; }
        if [[ ! -x "$IMAGE_ENV/bin/python3" ]]; then
            rm -rf "$IMAGE_ENV" && "$py312" -m venv "$IMAGE_ENV"
        fi
        if [[ "$(cat "$IMAGE_ENV/.kit-packages" 2>/dev/null)" != "${IMAGE_PACKAGES[*]}" ]]; then
            "$IMAGE_ENV/bin/python3" -m pip install -q "${IMAGE_PACKAGES[@]}"
            echo "${IMAGE_PACKAGES[*]}" >"$IMAGE_ENV/.kit-packages"
        fi
        if "$IMAGE_ENV/bin/python3" -c 'import pydantic' 2>/dev/null || "$IMAGE_ENV/bin/python3" -c 'import fastapi' 2>/dev/null; then
            echo "the image-shaped environment must not have pydantic or fastapi"; exit 1
        fi
    fi
    echo
    echo "Device call (the working tree travels; .whl is git-ignored, so carry it):"
    echo "  $DEVICE_CALL"
    echo "Its files come back from \$OUT: summary.json, gpu_check.log, env.txt, pytest-gpu.xml."
    exit 0
fi

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
    shift
    if [[ -x "$IMAGE_ENV/bin/python3" ]]; then export PATH="$IMAGE_ENV/bin:$PATH"; fi
fi
PY="${PYTHON:-python3}"
RES="${1:-${OUT:-$REPO/gpu-results}}"
mkdir -p "$RES"
RES="$(cd "$RES" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_kit.XXXXXX")"
SITE="${KIT_SITE:-$WORK/site}"
: >"$WORK/steps.tsv"
exec > >(tee "$RES/gpu_check.log") 2>&1
TEE_PID=$!
BUDGET_S="${BUDGET_S:-500}"
START=$SECONDS
FAILED=0

step() {  # step NAME LIMIT_S DEVICE(0|1|fake) CMD...: bounded, timed, recorded; never stops the script
    local name="$1" limit="$2" device="$3"; shift 3
    local left=$(( BUDGET_S - (SECONDS - START) ))
    echo
    echo "=== [$name] $(date -u +%H:%M:%S)"
    if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then
        echo "skipped: in SKIP_STEPS"
        printf '%s\tskipped\t0\n' "$name" >>"$WORK/steps.tsv"; return 0
    fi
    if [[ "$device" == 1 && "$DRY" == 1 ]]; then
        echo "skipped: dry run (needs a GPU)"
        printf '%s\tskipped\t0\n' "$name" >>"$WORK/steps.tsv"; return 0
    fi
    if [[ "$device" == fake && "$DRY" == 1 ]]; then
        echo "dry run: on the fake device (tests/fake_cupy.py), tiny sizes"
        set -- "$@" --fake
    fi
    if (( left < 5 )); then
        echo "failed: no time left in the ${BUDGET_S} s budget"
        printf '%s\tfailed\t0\n' "$name" >>"$WORK/steps.tsv"; FAILED=1; return 0
    fi
    (( limit > left )) && limit=$left
    local t0=$SECONDS rc=0
    timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" || rc=$?
    local status=ok
    if (( rc != 0 )); then status=failed; FAILED=1; fi
    (( rc == 124 || rc == 137 )) && echo "timed out after $limit s"
    echo "$status $name ($((SECONDS - t0)) s)"
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
}

environment() {
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  dry run: $DRY"
        echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
        echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
        echo "--- nvidia-smi"
        nvidia-smi 2>&1 || echo "(nvidia-smi failed or missing)"
        echo "--- packages"
        "$PY" -m pip list 2>/dev/null | grep -i -E '^(numpy|numba|cupy|cupy-cuda[0-9x]+|nvidia-cuda-nvrtc|pydantic|fastapi|pytest|hypothesis|httpx) ' || true
    } | tee "$RES/env.txt"
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 >"$WORK/device.txt" || true
}

install() {  # offline, into a directory of its own: the package and the missing dependencies
    compgen -G "$WHL/blendmatch-*.whl" >/dev/null || { echo "no .whl/blendmatch-*.whl: run scripts/gpu_check.sh --prepare first"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/pkg" "$WHL"/blendmatch-*.whl || return 1
    if compgen -G "$WHL/deps/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/deps" "$WHL"/deps/*.whl || return 1
    fi
    echo "installed into $SITE"
}

imports() {  # the package alone first (gpu, index and bench must not need the service's deps)
    PYTHONPATH="$SITE/pkg:$SITE/deps" "$PY" "$REPO/scripts/gpu_kit.py" imports "$WORK"
}

kit() { local s="$1"; shift; PYTHONPATH="$SITE/pkg:$SITE/deps" "$PY" "$REPO/scripts/gpu_kit.py" "$s" "$WORK" "$@"; }

gpu_files() { grep -l -E 'pytest\.mark\.gpu|def test_[A-Za-z0-9_]+\([^)]*\bengine\b' tests/test_gpu*.py tests/test_conformance.py 2>/dev/null | tr '\n' ' '; }

collect() {  # the gpu tests collect in this environment (a missing dependency fails here, not there)
    # shellcheck disable=SC2046
    PYTHONPATH="$SITE/pkg:$SITE/deps" "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider $(gpu_files) | tail -n 3
}

gpu_tests() {
    # shellcheck disable=SC2046
    BLENDMATCH_REQUIRE_GPU=1 PYTHONPATH="$SITE/pkg:$SITE/deps" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        --tb=short --maxfail=10 --junitxml="$RES/pytest-gpu.xml" $(gpu_files)
}

export -f environment install imports kit gpu_files collect gpu_tests
export PY REPO RES WORK SITE WHL DRY
echo "gpu_check: results in $RES (dry run: $DRY, budget ${BUDGET_S} s)"
step environment 30 0 environment
step install 60 0 install
step imports 60 0 imports
step collect 60 0 collect
step service-smoke 120 0 kit service-smoke
step trial 90 1 kit trial
step engine-bench 120 fake kit engine-bench
step service-bench 120 fake kit service-bench
step notebook 90 fake kit notebook
step gpu-tests 150 1 gpu_tests
step scale-self-test 120 1 kit scale
dry_flag=(); [[ "$DRY" == 1 ]] && dry_flag=(--dry-run)
PYTHONPATH="$SITE/pkg" "$PY" "$REPO/scripts/gpu_kit.py" summary "$WORK" "$RES" "${dry_flag[@]}" >/dev/null || {
    echo "could not write summary.json"; FAILED=1; }
echo
echo "=== summary ($((SECONDS - START)) s): $RES/summary.json"
cat "$WORK/steps.tsv"
rm -rf "$WORK"
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null || true
exit "$FAILED"
