"""CPU fp32 kernels for the decode step: paged decode attention, the KV-cache write,
RMSNorm and rotary (`csrc/cpu_ops.cpp`). The KV cache may be fp32, bf16 or fp16
(--kv-cache-dtype): the write rounds fp32 keys and values to it as torch's `.to()` does,
and attention widens what it reads back to fp32 (exactly: every 16-bit value is an fp32
one).

They live in the same JIT-built extension as the GGUF GEMV (`gguf_linear.load_extension`),
so `DUET_CPU_GGUF_KERNELS=0` or a failed build turns them off too; callers check
`available(t)` and keep their torch path otherwise. Each entry point raises RuntimeError
when the extension is missing.

Why: on CPU, the torch attention backend gathers every decode sequence's K/V blocks into a
padded tensor each layer before SDPA, and `F.rms_norm` runs as five or six aten ops, 61
calls a step at one sequence. bench/cpu_ops.py times each kernel against the torch path it
replaces (bench/RESULTS.md, CPU kernels).
"""

from __future__ import annotations

from types import ModuleType

import torch

from gpu_worker.ops.gguf_linear import load_extension


def _extension() -> ModuleType:
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the duet CPU kernels are not available (see gguf_linear)")
    return ext


KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The cache dtypes `paged_decode_attention` reads and `write_kv` stores into."""


def available(t: torch.Tensor) -> bool:
    """Whether the kernels can take `t`: a CPU fp32 tensor, and the extension built (the
    first call builds it)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and load_extension() is not None


def kv_cache_available(kv_cache: torch.Tensor) -> bool:
    """Whether the attention and KV-write kernels can take `kv_cache`: on CPU, of one of
    `KV_CACHE_DTYPES`, and the extension built."""
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.dtype in KV_CACHE_DTYPES
        and load_extension() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    vector: bool = True,
) -> torch.Tensor:
    """One query per sequence over its cached keys and values.

    q `[n, heads, head_dim]` fp32 (rows may be strided, each row contiguous); kv_cache
    `[2, num_blocks, block_size, kv_heads, head_dim]` fp32, bf16 or fp16, contiguous; block_tables
    `[n, max_blocks]` int32 and seq_lens `[n]` int32, contiguous. Query `i` attends to the
    first `seq_lens[i]` tokens of its blocks (its own new K/V already written); query head
    `h` reads kv head `h // (heads // kv_heads)`. Rows with seq_len 0 give zeros. Returns
    `[n, heads, head_dim]` fp32. `vector=False` forces the portable (non-AVX-512) path, for
    tests.
    """
    return _extension().paged_decode_attention(
        q, kv_cache, block_tables, seq_lens, float(scale), vector
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k and v `[tokens, kv_heads, head_dim]` fp32 (rows may be strided) into cache
    slots `slot_mapping` `[tokens]` int64 of `kv_cache` (contiguous fp32, bf16 or fp16,
    values rounded to nearest even as `.to()` does), in place: what the torch backend's two
    `index_copy_` calls do."""
    _extension().write_kv(k, v, kv_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(x * rsqrt(mean(x^2, -1) + eps)) * weight` over the last dimension of a contiguous
    fp32 `x`; each operation rounded to fp32 as in torch's decomposition, the mean of
    squares summed in double, so results differ from `F.rms_norm` only by summation order
    (within ~1e-6 relative)."""
    return _extension().rms_norm(x, weight, float(eps))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = residual + x` (fp32, as torch's add); returns
    `(rms_norm(new_residual, weight, eps), new_residual)`. x and residual contiguous and
    of the same shape."""
    out, new_residual = _extension().add_rms_norm(x, residual, weight, float(eps))
    return out, new_residual


def rotatable(qk: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotate_qk` takes `qk` [tokens, heads, head_dim] with tables like `cos`: fp32
    on CPU, each token's heads contiguous (a view into qkv is), the tables spanning the
    whole head."""
    return (
        available(qk)
        and qk.dim() == 3
        and qk.stride(2) == 1
        and qk.stride(1) == qk.shape[2]
        and cos.dtype == torch.float32
        and cos.is_contiguous()
        and cos.numel() == qk.shape[0] * qk.shape[2]
    )


def rotate_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of every head of `qk`: `qk * cos + roll(qk, head_dim / 2) * sin` with
    `cos`/`sin` [tokens, 1, head_dim] (sin's first half negated, as `apply_rotary` takes
    it), bit for bit `apply_rotary`'s values, into a new contiguous tensor."""
    return _extension().rotate_qk(qk, cos, sin)
