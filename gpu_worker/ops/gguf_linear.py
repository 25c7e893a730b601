"""Linear layers on GGUF-quantized weights for CPU decode.

A CPU decode step reads every weight once, so its speed is memory bandwidth over weight
bytes. The loader keeps, beside the dense fp32 weights, the GGUF file's own blocks of every
matrix in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (4.5-8.5 bits a weight instead
of 32; the K-quants repacked at load into units of 32 weights, within 3% of the file's
bytes), and a small C++ kernel (`csrc/gguf_gemv.cpp`, built at install by `kernel_build`)
multiplies fp32 activations by them: a dot-product loop up to 12 rows, a register-blocked
outer-product loop past that. It dequantizes each weight to exactly the fp32 value gguf's
`dequantize` gives, so results differ from the dense path only in summation order. A fused
layer whose parts differ in type (Q4_K_M's qkv) runs one call per type. Batches with more
rows than `MAX_QUANTIZED_ROWS` (prefill) keep the dense fp32 GEMM; other types (Q2_K,
Q3_K, the IQ types) stay dense.

`DUET_CPU_GGUF_KERNELS=0` turns the kernel off; so does a failed build, with one warning.
The same extension carries the other CPU kernels (`csrc/cpu_ops.cpp`, used through
`gpu_worker.ops.cpu_ops`: decode attention, KV write, RMSNorm), so the switch covers them too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import gguf
import numpy as np
import torch

from gpu_worker.ops import kernel_build
from gpu_worker.ops.kernel_build import kernels_enabled

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# GGML type -> weights per block in the file (k must be a multiple of it).
SUPPORTED_TYPES: dict[int, int] = {
    int(Q.Q4_0): 32,
    int(Q.Q4_1): 32,
    int(Q.Q5_0): 32,
    int(Q.Q5_1): 32,
    int(Q.Q8_0): 32,
    int(Q.Q4_K): 256,
    int(Q.Q5_K): 256,
    int(Q.Q6_K): 256,
}
# The per-32 types: bytes of fp16 scales at the front of each file block, which the kernel
# wants gathered at the front of the row (csrc layout note); the rest of a block is a unit.
_SCALE_BYTES = {int(Q.Q4_0): 2, int(Q.Q4_1): 4, int(Q.Q5_0): 2, int(Q.Q5_1): 4, int(Q.Q8_0): 2}

# Rows up to which the kernel runs; more go to MKL's fp32 sgemm on the dense copy. Chosen
# from bench/gguf_gemv.py (bench/RESULTS.md, gguf_gemv): the kernel beats dense fp32 over a
# layer up to 96 rows, and at 128 rows the down projection and the LM head are slower.
MAX_QUANTIZED_ROWS = 96


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernels (`kernel_build`: built at install, or on this first use under a
    lock that cannot outlive its holder); None, after one warning, when they are turned off,
    cannot be built, or another process's build outlasts the wait."""
    if not kernels_enabled():
        return None
    try:
        return kernel_build.load(kernel_build.cpu_kernels_spec())
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a compile error: go dense
        logger.warning(
            "duet CPU kernels unavailable, using dense fp32 weights and torch ops: %s", exc
        )
        return None


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight as GGUF blocks: `data` is uint8 [rows, row bytes] in the kernel's
    layout for `qtype` (csrc/gguf_gemv.cpp), one row per output feature. A fused weight
    whose parts differ in type (Q4_K_M files keep V in Q6_K beside Q/K in Q4_K) continues
    in `more`, the next rows' blocks of other types: one kernel call per type, their
    outputs side by side."""

    data: torch.Tensor
    qtype: int
    k: int
    more: tuple[QuantizedWeight, ...] = ()

    @property
    def n(self) -> int:
        return int(self.data.shape[0]) + sum(p.n for p in self.more)

    @classmethod
    def from_gguf(cls, blocks: np.ndarray, qtype: int, shape: Sequence[int]) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes and its (outermost-first) [n, k] shape."""
        n, k = (int(d) for d in shape)
        _, type_size = gguf.GGML_QUANT_SIZES[Q(qtype)]
        array = np.asarray(blocks, dtype=np.uint8).reshape(
            n, k // SUPPORTED_TYPES[qtype], type_size
        )
        if qtype in _SCALE_BYTES:
            head = _SCALE_BYTES[qtype]
            header, units = array[:, :, :head], array[:, :, head:]
        else:
            header, quants = _K_QUANT_REPACK[qtype](array)
            planes = 2 if qtype == int(Q.Q6_K) else int(qtype == Q.Q5_K)
            units = _pack_units(quants, planes)
        rows = np.concatenate([header.reshape(n, -1), units.reshape(n, -1)], axis=1)
        return cls(torch.from_numpy(np.ascontiguousarray(rows)), qtype, k)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
        """Row blocks stacked in order (the fused qkv / gate_up weights), each run of one
        type as one block; None when the widths differ, which leaves that layer dense."""
        first = parts[0]
        if any(p.k != first.k for p in parts):
            return None
        runs: list[tuple[int, list[torch.Tensor]]] = []  # (type, row blocks) in order
        for part in parts:
            for block in part.blocks():
                if runs and runs[-1][0] == block.qtype:
                    runs[-1][1].append(block.data)
                else:
                    runs.append((block.qtype, [block.data]))
        blocks = [QuantizedWeight(torch.cat(data), qtype, first.k) for qtype, data in runs]
        return QuantizedWeight(blocks[0].data, blocks[0].qtype, first.k, tuple(blocks[1:]))

    def blocks(self) -> list[QuantizedWeight]:
        """Each row block of one type, in order (just this weight when it has no `more`)."""
        head = QuantizedWeight(self.data, self.qtype, self.k) if self.more else self
        return [head, *(b for part in self.more for b in part.blocks())]

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        assert not self.more, "rows are permuted per GGUF tensor, before any stacking"
        return QuantizedWeight(self.data[torch.from_numpy(order)].contiguous(), self.qtype, self.k)

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k] as the kernel reads it (needs the extension)."""
        ext = load_extension()
        if ext is None:
            raise RuntimeError("the GGUF CPU kernels are not available")
        return torch.cat([ext.dequantize(b.data, b.qtype, b.k) for b in self.blocks()])

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
        if not self.more:
            return ext.gemm(x, self.data, self.qtype, bias)
        outs, start = [], 0
        for block in self.blocks():
            rows = int(block.data.shape[0])
            part_bias = None if bias is None else bias[start : start + rows]
            outs.append(ext.gemm(x, block.data, block.qtype, part_bias))
            start += rows
        return torch.cat(outs, dim=1)


def _pack_units(quants: np.ndarray, planes: int) -> np.ndarray:
    """[..., 32] quants below 2**(4 + planes) -> [..., 4 * planes + 16] unit bytes: each bit
    above the nibble as a little-endian uint32 plane (bit i: element i), then nibble byte i
    holding element i (low) and element 16 + i (high)."""
    nibbles = (quants[..., :16] & 0x0F) | ((quants[..., 16:] & 0x0F) << 4)
    bits = [np.packbits((quants >> (4 + p)) & 1, axis=-1, bitorder="little") for p in range(planes)]
    return np.concatenate([*bits, nibbles], axis=-1).astype(np.uint8)


def _k_scales_header(array: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K superblocks [n, s, bytes] -> [n, s, 20] headers: d and dmin (fp16 bytes),
    then the 8 sub-blocks' 6-bit (scale, min) pairs unpacked to a byte each, interleaved."""
    n, s, _ = array.shape
    scales, mins = gguf.quants.Q4_K.get_scale_min(array[:, :, 4:16].reshape(n * s, 12))
    pairs = np.stack([scales, mins], axis=-1).reshape(n, s, 16).astype(np.uint8)
    return np.concatenate([array[:, :, :4], pairs], axis=-1)


def _low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, s, 32 * j] bytes, each 32 holding two sub-blocks (low nibbles first) -> their
    [n, s, 2 * j, 32] nibbles in sub-block order."""
    n, s, size = qs.shape
    chunks = qs.reshape(n, s, size // 32, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=3).reshape(n, s, -1, 32)


def _repack_q4_k(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _k_scales_header(array), _low_nibbles(array[:, :, 16:144])


def _repack_q5_k(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # 32 bytes of 5th bits: bit u of byte i belongs to element i of sub-block u.
    qh = array[:, :, 16:48, None] >> np.arange(8, dtype=np.uint8)
    high = (qh & 1).swapaxes(2, 3)
    return _k_scales_header(array), _low_nibbles(array[:, :, 48:176]) | (high << 4)


def _repack_q6_k(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K superblocks: 128 bytes of low nibbles (two halves of 128 weights, each 64 bytes
    holding 4 sub-blocks), 64 of 2-bit highs (each half's 32 bytes holding 4 sub-blocks
    at bits 0, 2, 4, 6), 16 int8 scales (one per 16 weights) and d last."""
    n, s, _ = array.shape
    ql = array[:, :, :128].reshape(n, s, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, s, 8, 32)
    qh = array[:, :, 128:192].reshape(n, s, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = (qh & 0x03).reshape(n, s, 8, 32)
    header = np.concatenate([array[:, :, 208:210], array[:, :, 192:208]], axis=-1)
    return header, low | (high << 4)


_K_QUANT_REPACK = {int(Q.Q4_K): _repack_q4_k, int(Q.Q5_K): _repack_q5_k, int(Q.Q6_K): _repack_q6_k}


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
        if k % SUPPORTED_TYPES[qtype]:  # gguf's own rule; the kernel relies on it
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
