"""Triton kernels for the engine, one file per op, each with its torch reference beside it.

- `paged_attention`   decode attention over block tables, GQA-aware, split-K (flash decoding)
- `prefill_attention` varlen prefill with a paged prefix; serves mixed batches too
- `cache_ops`         write new K/V into their cache slots
- `rms_norm`          RMSNorm and fused residual-add + RMSNorm
- `rotary`            rotary embedding from precomputed cos/sin tables (HF rotate_half)
- `activation`        SiLU-and-mul over the fused gate/up projection
- `tuning`            the shapes the attention autotuners run over at start-up, one per key

Launchers run on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(`TRITON_INTERPRET=1`, set before triton is imported: `@triton.jit` picks the interpreter at
decoration time). There is no silent torch fallback; the `*_ref` functions are plain torch.

This module holds only the few helpers the launchers share; import launchers from their own
modules (`from kernels.paged_attention import paged_decode_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.testing


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def check_launchable(*tensors: torch.Tensor) -> bool:
    """Check that the tensors can go to a kernel; returns True on a real GPU (where launchers
    autotune) and False under the interpreter (where they run one fixed config)."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {t.device} and {device}")
    if is_interpreting():
        return False
    if device.type != "cuda":
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU); got {device}"
        )
    return True


def tuning_bench(kernel_call: Callable[[], object], quantiles: Sequence[float]) -> Any:
    """The attention autotuners' timer: 5 ms of warm-up and 25 ms of runs per config instead
    of Triton's 25 + 100. Start-up tuning times ~100 keys x ~6 configs per attention variant,
    and a kernel of microseconds still runs hundreds of times in 25 ms."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=list(quantiles))


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index the last dimension with stride 1 (and vectorize loads along it)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got {t.stride()}")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


@functools.cache
def _num_sms(index: int) -> int:  # cached: the query is not free, and launchers ask per call
    return torch.cuda.get_device_properties(index).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot`'s input_precision: full precision for fp32 inputs (tf32 would cost ~1e-3
    relative error); the backend's default (None) for fp16/bf16, where it does not apply."""
    return "ieee" if dtype == torch.float32 else None


def check_attention_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """Shapes, dtypes and strides shared by the decode and prefill attention launchers."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"head_dim differs: q {head_dim}, kv_cache {kv_cache.shape[4]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    # The cache may be narrower or wider than q (--kv-cache-dtype): the kernels convert
    # each key and value to q's dtype as they load it.
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"kv_cache must be fp16, bf16 or fp32, got {kv_cache.dtype}")
    if block_tables.ndim != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be a 2-D int32 or int64 tensor")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check_last_dim_contiguous("block_tables", block_tables)


def check_lengths(name: str, t: torch.Tensor, length: int) -> None:
    """A 1-D integer metadata tensor (seq_lens, context_lens, query_start_loc)."""
    if t.shape != (length,) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 tensor of shape [{length}]")
