#!/usr/bin/env bash
# Stage, here, what bench/gpu_check.sh needs on the device machine that its image lacks.
#
# The device has torch, triton, numpy, safetensors, tokenizers, transformers, jinja2, pytest
# and nvidia-ml-py, no network, and takes at most 64 MiB per call beside the repository
# (whose tracked files are ~3 MiB). Of what gpu_worker, the kernel tests and bench/ import,
# it lacks gguf, llguidance, msgspec and pyzmq (pyproject's worker and core dependencies,
# checked against the image's package list in /work/.library/device/KINDS.md). This writes
# the git-ignored .gpucarry/:
#   wheels/cp310 .. wheels/cp313   those four for each CPython the device may run, at the
#                                  versions installed here, so both sides run the same code
#   smollm2.json.gz                the built-in model's metadata and tensor table (~0.4 MB),
#                                  from which bench.random_model writes a random-weight
#                                  stand-in there instead of carrying the 98 MB GGUF
# Then run the device check with carry [".gpucarry"] (see the top of bench/gpu_check.sh).
# CARRY=DIR writes elsewhere and PYTHONS="3.11" limits the versions (the dry-run test does).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CARRY=${CARRY:-.gpucarry}
PACKAGES=(gguf llguidance msgspec pyzmq)
read -r -a PYTHONS <<<"${PYTHONS:-3.10 3.11 3.12 3.13}"
LIMIT_MIB=56 # of the 64 MiB a call carries; the rest is the repository itself

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels"
platforms=()
for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
    manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
for python in "${PYTHONS[@]}"; do
    dir=$CARRY/wheels/cp${python/./}
    mkdir -p "$dir"
    for name in "${PACKAGES[@]}"; do
        version=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$python" \
            --implementation cp "${platforms[@]}" -d "$dir" "$name==$version"
    done
done

model=$("$PY" -c "from shared.model_source import resolve_model as r; print(r('SmolLM2-135M-Instruct').path)")
"$PY" -m bench.random_model describe "$model" "$CARRY/smollm2.json.gz"

du -sh "$CARRY"/wheels/* "$CARRY/smollm2.json.gz"
size_mib=$(du -sm "$CARRY" | cut -f1)
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
    echo "gpu_prepare: $CARRY is ${size_mib} MiB, over the ${LIMIT_MIB} MiB that fits a call" >&2
    exit 1
fi
echo "gpu_prepare: $CARRY ready (${size_mib} MiB)"
