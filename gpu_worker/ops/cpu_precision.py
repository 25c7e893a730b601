"""`--cpu-precision exact|fast`: whether an fp32 model on the CPU may multiply in bf16.

exact, the default: every matmul in fp32 (MKL's sgemm on dense weights, duet's GGUF
kernel on the file's blocks, each weight the fp32 value gguf dequantizes it to), so
greedy outputs are transformers' fp32 ones. fast: where the CPU has bf16 dot-product
instructions (AVX512-BF16 or AMX-BF16, read at start), every projection and the LM head
get a packed bf16 copy of their weight (`gpu_worker.ops.linear`), which prefill and
batched decode multiply on (oneDNN: fp32 accumulation, the output rounded to bf16); a
decode step of up to 8 rows keeps the GGUF blocks, since it is bound by the bytes it
reads. Attention, norms, activations and the sampler stay fp32. Greedy outputs may then
differ from fp32's, as bf16 inference's do. Without those instructions oneDNN would
emulate bf16 more slowly than fp32 runs, so fast runs exact, with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gpu_worker.ops.linear import Linear, prepack

logger = logging.getLogger(__name__)

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of instructions that multiply bf16 pairs into fp32 sums."""


def bf16_instructions(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the given /proc/cpuinfo text) has bf16 dot products."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return any(flag in flags.split() for flag in BF16_FLAGS)


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed bf16 copy of an fp32 CPU weight; None where oneDNN cannot run one."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return prepack(weight.detach().to(torch.bfloat16))


def fast_linears(model: torch.nn.Module) -> int:
    """Give every `Linear` of `model` its bf16 copy; the number that got one."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.fast_weight = bf16_copy(module.weight)
            count += module.fast_weight is not None
    return count


def wants_fast(precision: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` runs fast: asked for (`precision`, checked by
    EngineConfig), an fp32 CPU model, and a CPU with bf16 instructions (a warning says why
    not otherwise)."""
    if precision != "fast" or device.type != "cpu" or dtype != torch.float32:
        return False
    if not bf16_instructions():
        logger.warning(
            "--cpu-precision fast: this CPU has no bf16 dot products (%s); running exact fp32",
            " or ".join(BF16_FLAGS),
        )
        return False
    return True
