"""Linear layers on GGUF-quantized weights for CPU decode.

A CPU decode step reads every weight once, so its speed is memory bandwidth over weight
bytes. The loader keeps, beside the dense fp32 weights, the GGUF file's own Q4_0/Q4_1/Q8_0
blocks (4.5-8.5 bits a weight instead of 32), and a small C++ kernel (`csrc/gguf_gemv.cpp`,
JIT-built once per machine) multiplies fp32 activations by them: a dot-product loop up to
8 rows, a register-blocked outer-product loop past that. It dequantizes each weight to
exactly the fp32 value gguf's `dequantize` gives, so results differ from the dense path
only in summation order. Batches with more rows than `MAX_QUANTIZED_ROWS` (prefill) keep
the dense fp32 GEMM.

`DUET_CPU_GGUF_KERNELS=0` turns the kernel off; so does a failed build, with one warning.
The same extension carries the other CPU kernels (`csrc/cpu_ops.cpp`, used through
`gpu_worker.ops.cpu_ops`: decode attention, KV write, RMSNorm), so the switch covers them too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "DUET_CPU_GGUF_KERNELS"

# GGML type -> bytes per block of 32 weights.
SUPPORTED_TYPES: dict[int, int] = {
    int(gguf.GGMLQuantizationType.Q4_0): 18,
    int(gguf.GGMLQuantizationType.Q4_1): 20,
    int(gguf.GGMLQuantizationType.Q8_0): 34,
}

# Rows up to which the kernel runs; more go to MKL's fp32 sgemm on the dense copy. Chosen
# from bench/gguf_gemv.py (bench/RESULTS.md, gguf_gemv): the kernel beats dense fp32 over a
# layer up to 96 rows, and at 128 rows the down projection and the LM head are slower.
MAX_QUANTIZED_ROWS = 96

# One extension module for all CPU kernels: gguf_gemv.cpp defines the module and registers
# cpu_ops.cpp's functions (attention, KV write, RMSNorm; used through gpu_worker.ops.cpu_ops).
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gguf_gemv.cpp", "cpu_ops.cpp")]


def kernels_enabled() -> bool:
    """False when the environment turns the quantized CPU kernels off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _build_tag() -> str:
    """A short hash of the CPU's feature flags and of where the sources are: the build uses
    -march=native, so a torch extensions dir shared between machines must not hand one
    CPU's binary to another; and two checkouts on one machine must not take turns
    rebuilding one directory (torch rebuilds when the source paths change)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    where = str(_SOURCES[0].parent.resolve())
    return hashlib.sha1(f"{flags}\0{where}".encode()).hexdigest()[:8]


def _put_ninja_on_path() -> None:
    """torch's JIT build runs `ninja` from PATH; the pip package (the `worker` extra)
    installs it into the venv's bin, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernel, built on first use (torch's file lock serializes concurrent
    builds); None, after one warning, when it is disabled or cannot be built."""
    if not kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        return load(
            name=f"duet_cpu_kernels_{_build_tag()}",
            sources=[str(s) for s in _SOURCES],
            # -ffp-contract=off keeps gguf's separate multiply and add when dequantizing;
            # -fopenmp makes at::parallel_for use torch's (already loaded) OpenMP pool.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a compile error: go dense
        logger.warning(
            "duet CPU kernels unavailable, using dense fp32 weights and torch ops: %s", exc
        )
        return None


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight as GGUF blocks: `data` is uint8 [n, k / 32 * block_bytes], each row
    the blocks of one output feature in the file's layout."""

    data: torch.Tensor
    qtype: int
    k: int

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    @classmethod
    def from_gguf(cls, blocks: np.ndarray, qtype: int, shape: Sequence[int]) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes and its (outermost-first) [n, k] shape."""
        n, k = (int(d) for d in shape)
        block_bytes = SUPPORTED_TYPES[qtype]
        array = np.asarray(blocks, dtype=np.uint8).reshape(n, k // 32, block_bytes)
        # The kernel wants each row's fp16 scales first, then its quants (csrc layout note).
        head = 4 if qtype == int(gguf.GGMLQuantizationType.Q4_1) else 2
        scales, quants = array[:, :, :head].reshape(n, -1), array[:, :, head:].reshape(n, -1)
        rows = np.concatenate([scales, quants], axis=1)
        return cls(torch.from_numpy(np.ascontiguousarray(rows)), qtype, k)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
        """Row blocks stacked in order (the fused qkv / gate_up weights); None when the
        parts mix types or widths, which leaves that layer dense."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.k != first.k for p in parts):
            return None
        return QuantizedWeight(torch.cat([p.data for p in parts]), first.qtype, first.k)

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        return QuantizedWeight(self.data[torch.from_numpy(order)].contiguous(), self.qtype, self.k)

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k] as the kernel reads it (needs the extension)."""
        ext = load_extension()
        if ext is None:
            raise RuntimeError("the GGUF CPU kernels are not available")
        return ext.dequantize(self.data, self.qtype, self.k)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `linear` should run for this input: CPU fp32 decode-sized batches."""
        return (
            x.dim() == 2
            and x.shape[0] <= MAX_QUANTIZED_ROWS
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.shape[1] == self.k
        )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] fp32 -> x @ W^T (+ bias) [m, n] fp32."""
        ext = load_extension()
        assert ext is not None, "QuantizedWeight.linear without the extension"
        return ext.gemm(x, self.data, self.qtype, bias)


def gguf_quantized_weights(
    tensors: Sequence[tuple[str, gguf.ReaderTensor]], permutations: Mapping[str, np.ndarray]
) -> dict[str, QuantizedWeight]:
    """HF name -> raw blocks of each 2-D tensor in a supported type; `permutations` gives
    the row order to apply by name (the loader's Q/K unpermute, as row indices)."""
    out: dict[str, QuantizedWeight] = {}
    for name, tensor in tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in SUPPORTED_TYPES or len(tensor.shape) != 2:
            continue
        # gguf lists dimensions innermost first.
        k, n = (int(d) for d in tensor.shape)
        if k % 32:
            continue
        weight = QuantizedWeight.from_gguf(tensor.data, qtype, (n, k))
        if name in permutations:
            weight = weight.permute_rows(permutations[name])
        out[name] = weight
    return out


def quantized_kernels_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` should get quantized copies (builds the
    extension on first call)."""
    return device.type == "cpu" and dtype == torch.float32 and load_extension() is not None
