#!/usr/bin/env bash
# GPU check for a CUDA machine (written for one H200): kernel tests on CUDA, end-to-end greedy
# fidelity against Hugging Face, then the kernel benchmark.
#
# Run from the repository root:  PYTHONPATH=. bash scripts/gpu_check.sh
# Logs and kernel_bench.json go to $OUT when it is set, else to the current directory.
# Each stage has its own time limit (about 7.5 minutes in all) and a failing stage does not stop the
# next one; the exit status is non-zero if any stage failed.

set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-.}"
OUT_DIR="${OUT:-.}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
declare -a SUMMARY=()
FAILED=0

run_stage() {  # name, time limit (s), log file, command...
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "=== $name (limit ${limit}s) ==="
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("PASS  $name (${took}s)")
    else
        [ "$rc" -eq 124 ] && SUMMARY+=("FAIL  $name: timed out after ${limit}s") || SUMMARY+=("FAIL  $name: exit $rc (${took}s)")
        FAILED=1
    fi
}

echo "=== environment ==="
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || echo "nvidia-smi unavailable"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1

run_stage "kernel tests (CUDA)" 170 kernel_tests.log \
    "$PY" -m pytest tests/kernels -q -p no:cacheprovider

if [ -f tests/engine/test_fidelity.py ]; then
    run_stage "fidelity vs Hugging Face" 120 fidelity.log \
        "$PY" -m pytest tests/engine/test_fidelity.py -q -p no:cacheprovider
else
    SUMMARY+=("SKIP  fidelity vs Hugging Face: tests/engine/test_fidelity.py not found")
fi

run_stage "kernel benchmark" 160 kernel_bench.log \
    "$PY" scripts/kernel_bench.py --budget-s 120 --out "$OUT_DIR/kernel_bench.json"

echo
echo "=== gpu_check summary ==="
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $FAILED
