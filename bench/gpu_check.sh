#!/usr/bin/env bash
# The GPU path's device check, as ONE self-contained call that fits 9 minutes on the device.
#
#   here, first:   bash bench/gpu_prepare.sh        # writes .gpucarry/ (git-ignored, ~17 MiB)
#   the call:      run(command="bash bench/gpu_check.sh", carry=[".gpucarry"], timeout_s=590)
#   dry run here:  bash bench/gpu_check.sh --device cpu [--quick]
#
# It needs nothing from an earlier call: it finds the device's Python version first, installs
# the carried wheels for that version into a fresh folder, writes a random-weight stand-in
# for the built-in SmolLM2-135M there (same shapes, tokenizer and quantization types:
# bench/offline/stand_ins.py), then runs four steps, each under its own limit (the LIMITS below),
# never past BUDGET_S (520 s) in all:
#   kernel-tests   tests/kernels (the engine tests aside), on CUDA
#   engine-tests   tests/kernels/test_cuda_graphs.py, test_kv_sizing.py, test_lora_engine.py -m cuda:
#                  graphs = eager, Triton ~ torch, the profiled KV budget holds at 0.95
#   kernel-bench   python -m bench.kernels: decode (batch 1/32/256 x context 1k/8k/32k) against copy
#                  bandwidth and SDPA, prefill TFLOP/s against SDPA
#   engine-bench   python -m bench.gpu_engine: the engine with and without decode graphs, and with
#                  graphs and async scheduling, at 1, 32 and 256 concurrent, on the built-in model's
#                  stand-in and a random 1B Llama (bf16), and its time outside the forward at batch 256
# Results, in $OUT (7 files; a device call returns at most 8): summary.json (each step's
# status, seconds and pytest counts), setup.txt, tests.txt, bench.txt, kernels.json,
# kernels-engine.json, and RESULTS.md (the sections to paste into bench/RESULTS.md).
#
# --device cpu is the same path on this machine: the kernel tests run under TRITON_INTERPRET=1
# (the CUDA-only ones skip with their reason), the engine bench runs on the CPU at small
# sizes, and the kernel bench, which times CUDA only, is recorded as skipped. --quick
# (tests/integration/test_gpu_check_dry_run.py) writes a 2-layer stand-in and runs a subset.
# CARRY=DIR reads what gpu_prepare.sh wrote elsewhere than .gpucarry.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
QUICK=0
while [ $# -gt 0 ]; do
    case "$1" in
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "usage: gpu_check.sh [--device cuda|cpu] [--quick]" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda | cpu) ;; *) echo "--device takes cuda or cpu" >&2; exit 2 ;; esac

BUDGET_S=${BUDGET_S:-520}
# Seconds per step: set-up, kernel tests, engine tests, kernel bench, engine bench. The CPU
# runs the kernel tests in Triton's interpreter, loads the 30-layer stand-in twice for the
# engine bench, and has no kernel bench to run. LIMITS="a b c d e" rebalances them;
# STEPS="engine-tests engine-bench" runs only those after the set-up (a second device call
# in what is left of the session's device time).
default_limits="50 110 60 130 170"
[ "$DEVICE" = cpu ] && default_limits="40 190 80 0 170"
read -r -a LIMITS <<<"${LIMITS:-$default_limits}"
CARRY=${CARRY:-.gpucarry}
started=$(date +%s%N)
deadline=$(($(date +%s) + BUDGET_S))
OUT=${OUT:-/tmp/duet-gpu-out}
export OUT
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3 # the device image's, which holds torch and triton
fi
work=$(mktemp -d /tmp/duet-check.XXXXXX)
steps=$work/steps.tsv
: >"$steps"

# seconds_since NANOSECONDS: elapsed seconds with milliseconds, in bash alone (no bc there).
seconds_since() {
    local ms=$((($(date +%s%N) - $1) / 1000000))
    printf '%d.%03d' $((ms / 1000)) $((ms % 1000))
}

# record NAME STATUS RC SECONDS LIMIT DETAIL
record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$steps"
    echo "[gpu_check] $1: $2 (${4}s) $6"
}

finish() {
    local wall
    wall=$(seconds_since "$started")
    local quick=()
    [ "$QUICK" = 1 ] && quick=(--quick)
    "$PY" -m bench.gpu_check_report "$OUT" "$steps" --device "$DEVICE" --python "${pyver:-?}" \
        --budget "$BUDGET_S" --wall "$wall" "${quick[@]}"
    local rc=$?
    rm -rf "$work"
    exit $rc
}

# The device's Python decides which wheels install: find it before anything else.
if ! pyver=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>&1); then
    echo "gpu_check: $PY does not run: $pyver" >&2
    exit 1
fi
wheels=$CARRY/wheels/$pyver
manifest=$CARRY/smollm2.json.gz
if [ ! -d "$wheels" ] || [ ! -f "$manifest" ]; then
    have=$(ls "$CARRY/wheels" 2>/dev/null | tr '\n' ' ')
    record setup failed "" 0 0 "no wheels for $pyver in $CARRY/wheels (have: ${have:-none}) or no model manifest: run bench/gpu_prepare.sh here and carry $CARRY"
    finish
fi

# step NAME LIMIT LOGFILE COMMAND...: run under min(LIMIT, what is left of the budget).
step() {
    local name=$1 cap=$2 log=$OUT/$3
    shift 3
    if [ -n "${STEPS:-}" ] && [ "$name" != setup ] && [[ " $STEPS " != *" $name "* ]]; then
        record "$name" skipped "" 0 "$cap" "not in STEPS ($STEPS)"
        return
    fi
    local left=$((deadline - $(date +%s)))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        record "$name" skipped "" 0 "$cap" "out of time: ${left}s of the ${BUDGET_S}s budget left"
        return
    fi
    echo "=== $name (limit ${limit}s): $*" >>"$log"
    local t0 rc status detail
    t0=$(date +%s%N)
    timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
    0) status=passed ;;
    124 | 137) status="timed out" ;;
    *) status=failed ;;
    esac
    # pytest's last line ("3 passed, 2 skipped in 9.81s"), else the log's last line.
    detail=$(tail -n 40 "$log" | grep -E '(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' |
        tail -1 | sed -E 's/^=+ //; s/ =+$//')
    [ -z "$detail" ] && detail=$(tail -n 1 "$log" | cut -c1-200)
    record "$name" "$status" "$rc" "$(seconds_since "$t0")" "$limit" "$detail"
}

# ---- setup: wheels and the stand-in model, in a folder no earlier call has touched --------
site=$work/site
layers=()
[ "$QUICK" = 1 ] && layers=(--num-layers 2)
{
    echo "device: $DEVICE, python: $PY ($pyver), quick: $QUICK, budget: ${BUDGET_S}s"
    uname -a
    if [ "$DEVICE" = cuda ]; then nvidia-smi; fi
} >"$OUT/setup.txt" 2>&1
# Run by `step` (under `timeout`, which takes programs only): $1 python, $2 site, $3 wheels,
# $4 the model manifest, then bench.random_model's options.
setup_script='
"$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$3"/*.whl &&
export PYTHONPATH="$2:$PWD" &&
"$1" -m bench.random_model write "$4" "$2" "${@:5}" &&
"$1" -c "import torch, triton, msgspec, zmq, gguf, llguidance
print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.cuda.is_available())"'
step setup "${LIMITS[0]}" setup.txt bash -c "$setup_script" setup "$PY" "$site" "$wheels" "$manifest" \
    "${layers[@]}"
if ! grep -q "^setup	passed" "$steps"; then finish; fi

export PYTHONPATH="$site:$PWD"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET # the kernel tests' conftest sets it where there is no CUDA
# -v: each test's name is in the log before it runs, so a step cut off at its limit shows where.
# Each failure's traceback as it happens and a per-test limit, so a step cut off at its own
# limit still shows why; the slowest tests, to size the limits.
pytest=("$PY" -m pytest -v -rfEs -p no:cacheprovider -p tests.helpers.instant_failures
    --timeout="${TEST_TIMEOUT:-100}" --durations=12)

# ---- tests ------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then
    step kernel-tests "${LIMITS[1]}" tests.txt "${pytest[@]}" tests/kernels/test_rms_norm.py
    step engine-tests "${LIMITS[2]}" tests.txt "${pytest[@]}" -m cuda \
        tests/kernels/test_cuda_graphs.py
else
    # KERNEL_TESTS="files..." narrows a second call to what the first did not finish.
    read -r -a kernel_tests <<<"${KERNEL_TESTS:-tests/kernels}"
    step kernel-tests "${LIMITS[1]}" tests.txt "${pytest[@]}" "${kernel_tests[@]}" \
        --ignore=tests/kernels/test_cuda_graphs.py
    # On CUDA the CUDA engine tests; here the file's CPU graph-path tests too (the CUDA ones
    # skip): those run CPU tensors through Triton, which only the interpreter accepts.
    engine_marks=()
    [ "$DEVICE" = cuda ] && engine_marks=(-m cuda)
    # With the KV sizing's CUDA tests: the profiled budget at --gpu-memory-utilization 0.95
    # holds through a max-size prefill and a max-batch decode.
    step engine-tests "${LIMITS[2]}" tests.txt "${pytest[@]}" "${engine_marks[@]}" \
        tests/kernels/test_cuda_graphs.py tests/unit/test_kv_sizing.py tests/unit/test_lora_engine.py
fi

# ---- benchmarks -------------------------------------------------------------------------
if [ "$DEVICE" = cuda ]; then
    kernel_sizes=()
    [ "$QUICK" = 1 ] && kernel_sizes=(--quick)
    step kernel-bench "${LIMITS[3]}" bench.txt "$PY" -m bench.kernels "${kernel_sizes[@]}"
    if [ "$QUICK" = 1 ]; then
        engine_sizes=(--models smollm2 --concurrency 1 32)
    else
        engine_sizes=(--models smollm2 llama-1b --concurrency 1 32 256)
    fi
else
    record kernel-bench skipped "" 0 0 "CUDA only: it times the Triton kernels on the GPU"
    engine_sizes=(--device cpu --models smollm2 --concurrency 1 2 --max-output 8 --repeats 1
        --kv-cache-gb 0.25)
fi
step engine-bench "${LIMITS[4]}" bench.txt "$PY" -m bench.gpu_engine "${engine_sizes[@]}"
finish
