#!/usr/bin/env bash
# Stage, here, what a GPU run needs that the device image lacks (see bench/gpu_check.sh).
#
# The device machine has torch, triton, transformers, tokenizers, jinja2 and pytest, no
# network, and takes at most 64 MiB per call beside the repository. So this writes two
# git-ignored folders, each under that limit:
#   .gpucarry/a  wheels for Python 3.12 (gguf, llguidance, msgspec) + the model's first half
#   .gpucarry/b  the model's second half and its checksum
# Then: run `bash bench/gpu_check.sh kernels` carrying .gpucarry/a, and
#       `bash bench/gpu_check.sh engine` carrying .gpucarry/b (the machine keeps a).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

rm -rf .gpucarry
mkdir -p .gpucarry/a/whl .gpucarry/b
platforms=()
for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
    manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
for name in gguf llguidance msgspec; do
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .gpucarry/a/whl "$name==$version"
done

model=$("$PY" -c "from shared.model_source import resolve_model as r; print(r('SmolLM2-135M-Instruct').path)")
split -n 2 -d "$model" .gpucarry/part-
mv .gpucarry/part-00 .gpucarry/a/
mv .gpucarry/part-01 .gpucarry/b/
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > .gpucarry/b/model.sha256
du -sh .gpucarry/a .gpucarry/b
