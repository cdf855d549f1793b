#!/usr/bin/env bash
# attnkit on a CUDA machine, from nothing but this repository (and Python 3.11+):
#
#   bash benchmarks/gpu/run.sh             # venv, torch if absent, attnkit[dev]; cuda tests; benchmarks
#   bash benchmarks/gpu/run.sh --dry-run   # the Python parts on the CPU at tiny sizes (no install)
#
# Steps (each with its own time limit; about 8 minutes in all):
#   1. a virtual environment in .venv-gpu (reusing an installed torch: --system-site-packages);
#      torch from the package index when it does not import; attnkit with its dev extra
#      (editable). Without network access an installed torch and pytest are used as they are,
#      and attnkit is imported from src/.
#   2. the tests marked `cuda` (`pytest -m cuda`) of the files that hold them.
#   3. the core benchmarks (python -m attnkit.benchmarking.gpu): SDPA, FlexAttention against
#      attnkit's block-sparse attention, chunked sparsemax and additive attention, decoding,
#      the linear family; each case in its own process with a time limit.
#   4. one markdown table: $OUT/RESULTS-gpu.md when OUT is set, else benchmarks/gpu/RESULTS-gpu.md,
#      with the GPU's name, torch and CUDA versions and the tests' summary line.
#
# Environment: PYTHON (default python3), OUT (where the table goes), ATTNKIT_GPU_CASES
# (comma-separated cases, default all), ATTNKIT_GPU_TIMEOUT (seconds per case, default 90),
# ATTNKIT_GPU_BUDGET (seconds for all cases, default 330).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
DEST="${OUT:-$ROOT/benchmarks/gpu}"
mkdir -p "$DEST"
REPORT="$DEST/RESULTS-gpu.md"
CASES="${ATTNKIT_GPU_CASES:-sdpa,flex,sparsemax,additive,decode,retention,mamba2,gated_deltanet}"
TIMEOUT="${ATTNKIT_GPU_TIMEOUT:-90}"
BUDGET="${ATTNKIT_GPU_BUDGET:-330}"
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown argument '$arg' (expected --dry-run or nothing)" >&2; exit 2 ;;
    esac
done

"$PYTHON" - <<'EOF' || { echo "run.sh: Python 3.11 or newer is needed ($PYTHON)" >&2; exit 2; }
import sys
raise SystemExit(0 if sys.version_info >= (3, 11) else 1)
EOF

# attnkit from src/ when it is not installed (a dry run, or no network for the install)
with_src() {
    if ! "$PY" -c "import attnkit" >/dev/null 2>&1; then
        export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

if [ "$DRY" = 1 ]; then
    PY="$PYTHON"
    with_src
    "$PY" -m attnkit.benchmarking.gpu --dry-run --cases "$CASES" --out "$REPORT" >/dev/null
    status=$?
    echo "run.sh --dry-run: wrote $REPORT (exit $status)"
    exit $status
fi

start=$(date +%s)
if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    # a Python that has torch already (an image's own environment, perhaps itself a venv that a
    # new --system-site-packages venv would not see): used as it is, attnkit from src/
    PY="$PYTHON"
    echo "== using $("$PY" -c 'import sys; print(sys.executable)') and its torch"
fi
VENV="$ROOT/.venv-gpu"
if [ -n "${PY:-}" ]; then
    :
elif [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv --system-site-packages "$VENV" || exit 1
fi
if [ -z "${PY:-}" ]; then
    PY="$VENV/bin/python"
    PIP=("$PY" -m pip install --disable-pip-version-check -q)
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "== installing torch"
        timeout 300 "${PIP[@]}" torch || echo "run.sh: torch could not be installed" >&2
    fi
    echo "== installing attnkit[dev]"
    if ! timeout 180 "${PIP[@]}" -e ".[dev]"; then
        echo "run.sh: 'pip install -e .[dev]' failed (no network?); using src/ and what is installed" >&2
        timeout 60 "${PIP[@]}" --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
    fi
fi
with_src
"$PY" - <<'EOF' || exit 1
import torch
if not torch.cuda.is_available():
    raise SystemExit("run.sh: torch sees no CUDA device; run with --dry-run on a CPU machine")
print(f"== {torch.cuda.get_device_name()}; torch {torch.__version__}; CUDA {torch.version.cuda}")
EOF

TESTS_LOG="$DEST/pytest-cuda.log"
files=$(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
if "$PY" -c "import pytest" >/dev/null 2>&1 && [ -n "$files" ]; then
    echo "== pytest -m cuda ($(echo $files | wc -w) files)"
    # shellcheck disable=SC2086  # one argument per file
    timeout 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider $files >"$TESTS_LOG" 2>&1
    code=$?
    [ $code = 124 ] && echo "pytest -m cuda: stopped at the 150 s limit" >>"$TESTS_LOG"
    tail -n 3 "$TESTS_LOG"
else
    echo "pytest not available or no cuda-marked tests: tests not run" >"$TESTS_LOG"
fi

echo "== benchmarks: $CASES"
"$PY" -m attnkit.benchmarking.gpu --device cuda --cases "$CASES" --timeout "$TIMEOUT" \
    --budget "$BUDGET" --tests-summary "$TESTS_LOG" --out "$REPORT"
status=$?
echo "== wrote $REPORT in $(( $(date +%s) - start )) s (exit $status)"
exit $status
