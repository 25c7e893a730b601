"""Write new K/V into their paged cache slots.

One program per token copies all of its KV heads for both K and V. Slot `s` is block
`s // block_size`, offset `s % block_size` in the `[2, num_blocks, block_size, num_kv_heads,
head_dim]` cache; a negative slot (a padding token, e.g. in a CUDA-graph batch) is skipped.
The cache may hold another dtype than k/v (--kv-cache-dtype): values are converted to it
(rounded to nearest) as they are stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import check_last_dim_contiguous, check_launchable


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_kv_heads,
    head_dim,
    PAGE_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
    dst_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k_offs = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + k_offs, mask=mask)
    tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_offs = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(v_ptr + v_offs, mask=mask)
    tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v `[num_tokens, num_kv_heads, head_dim]` (any token/head strides) into
    `kv_cache` (fp32, bf16 or fp16: values converted to it) at `slot_mapping`
    `[num_tokens]` (int32/int64; slots < 0 are skipped)."""
    check_launchable(k, v, kv_cache, slot_mapping)
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [tokens, kv_heads, head_dim]: {k.shape}, {v.shape}")
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != k.shape[1:]:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not match k {tuple(k.shape)}: "
            "expected [2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be an int32/int64 tensor with one slot per token")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v dtypes differ: {k.dtype}, {v.dtype}")
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"kv_cache must be fp16, bf16 or fp32, got {kv_cache.dtype}")
    for name, t in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        PAGE_SIZE=kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain torch: what `write_kv_cache` does."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = kv_cache.shape[3:]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(kv_cache.dtype)
