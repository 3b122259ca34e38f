#!/usr/bin/env bash
# GPU check for a CUDA machine (written for one H200): kernel tests on CUDA, end-to-end greedy
# fidelity against Hugging Face, the kernel benchmark, then `batchgen bench` on a random-weight model
# of the default model's shape against transformers' static batches.
#
# Run from the repository root:  bash scripts/gpu_check.sh [TOKENIZER_DIR]
# TOKENIZER_DIR holds the default model's tokenizer and config files (the tiny test models and the
# bench model take them from there, for a machine that cannot hold the default model's weights); make
# it on a machine with the model:  python scripts/gpu_check_files.py DIR
# batchgen is installed (editable, no dependencies: the machine's torch and Triton stay) when it is not
# importable. Logs and JSON go to $OUT when it is set, else to the current directory. Each stage has
# its own time limit (about 10 minutes in all) and a failing stage does not stop the next one; the exit
# status is non-zero if any stage failed.

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
lscpu | grep -E 'Model name|^CPU\(s\)' || true

if ! "$PY" -c "import batchgen.kernels" 2>/dev/null; then
    echo "=== installing batchgen (editable, --no-deps) ==="
    "$PY" -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -3
    "$PY" -c "import batchgen.kernels" || echo "batchgen.kernels still not importable: the stages below will fail"
fi
FILES_DIR="${1:-}"
if [ -n "$FILES_DIR" ]; then
    export BATCHGEN_TEST_TOKENIZER_DIR="$(cd "$FILES_DIR" && pwd)"
fi

run_stage "kernel tests (CUDA)" 120 kernel_tests.log \
    "$PY" -m pytest tests/kernels/triton tests/kernels/test_registry.py -q -p no:cacheprovider

if [ -f tests/engine/test_fidelity.py ]; then
    run_stage "fidelity vs Hugging Face" 150 fidelity.log \
        "$PY" -m pytest tests/engine/test_fidelity.py tests/engine/test_spec_decode_fidelity.py -q -p no:cacheprovider
else
    SUMMARY+=("SKIP  fidelity vs Hugging Face: tests/engine/test_fidelity.py not found")
fi

run_stage "kernel benchmark" 80 kernel_bench.log \
    "$PY" benchmarks/kernels/kernel_bench.py --budget-s 50 --out "$OUT_DIR/kernel_bench.json"

if [ -n "$FILES_DIR" ]; then
    BENCH_MODEL="$(mktemp -d)/random-smollm2"
    run_stage "engine bench (random weights, default model's shape)" 130 engine_bench.log bash -c "
        '$PY' scripts/gpu_check_files.py --random-model '$BENCH_MODEL' --from '$BATCHGEN_TEST_TOKENIZER_DIR' &&
        '$PY' -m batchgen bench --model '$BENCH_MODEL' --dist longtail --num-prompts 128 --seed 7 --static-batch-size 32 \
            --mode continuous,static --baselines hf-static --no-ceiling --no-enable-prefix-caching \
            --output '$OUT_DIR/engine_bench.json'"
    # The measured choice of prefill attention (Triton or SDPA per chunk length): its table, then the
    # same continuous run with Triton for every chunk (--kernels native measures nothing) to compare.
    run_stage "kernel table and Triton-only A/B" 120 kernel_choice.log bash -c "
        '$PY' -m batchgen tune --model '$BENCH_MODEL' --device cuda &&
        '$PY' -m batchgen bench --model '$BENCH_MODEL' --dist longtail --num-prompts 128 --seed 7 \
            --mode continuous --kernels native --no-ceiling --no-enable-prefix-caching \
            --output '$OUT_DIR/engine_bench_triton_only.json'"
else
    SUMMARY+=("SKIP  engine bench: no TOKENIZER_DIR given")
fi

echo
echo "=== gpu_check summary ==="
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $FAILED
