"""Rotary position embedding from precomputed cos/sin tables (HF rotate_half convention).

For each token at `position` and each head, with `x1, x2` the two halves of head_dim and
`c, s` the `[head_dim // 2]` cosines and sines of that position's angles:
`out = cat(x1 * c - x2 * s, x2 * c + x1 * s)`, which is HF's `x * cos + rotate_half(x) * sin`.

Two table layouts are accepted, told apart by their width:
- half width `[max_positions, head_dim // 2]`: `c` and `s` themselves (`freqs.cos()/.sin()`);
- full width `[max_positions, head_dim]`: `gpu_worker.models.llama.RotaryEmbedding`'s
  `cos_cache = [c, c]` and `sin_cache = [-s, s]`; the kernel reads `c` from the first half of
  cos and `s` from the second half of sin.

The kernel only indexes the tables: whatever frequency scheme built them (plain theta, llama3
low/high-frequency scaling, GGUF per-pair factors; see `gpu_worker.models.llama.rope_inv_freq`)
is already baked into cos/sin, so nothing here depends on the scaling. Math in fp32, one
rounding to the input dtype at the end, as the torch model does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import check_last_dim_contiguous, check_launchable


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_h,
    stride_oh,
    cos,
    sin,
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    dst = out_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
    # Both halves are loaded before either is stored, so out may alias x (in place).
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    sin_offset,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin_row = sin_ptr + pos * stride_sin + sin_offset
    sin = tl.load(sin_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh,
        cos, sin, num_q_heads, HALF, HALF_PAD, Q_HEADS_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh,
        cos, sin, num_k_heads, HALF, HALF_PAD, K_HEADS_PAD,
    )  # fmt: skip


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[tokens, num_heads, head_dim]` and k `[tokens, num_kv_heads, head_dim]` by
    `positions` `[tokens]`, reading rows of `cos_cache`/`sin_cache` (either layout of the
    module docstring, e.g. `RotaryEmbedding.cos_cache`/`sin_cache`). Returns `(q, k)` rotated:
    new tensors, or q and k themselves when `inplace`. q and k may be strided views (e.g. of
    a fused QKV output)."""
    check_launchable(q, k, positions, cos_cache, sin_cache)
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    if (
        cos_cache.ndim != 2
        or cos_cache.shape[1] not in (half, head_dim)
        or sin_cache.shape != cos_cache.shape
    ):
        raise ValueError(f"cos/sin caches must both be [max_positions, {half} or {head_dim}]")
    # Full-width tables hold [-s, s] in sin: +s is its second half.
    sin_offset = half if cos_cache.shape[1] == head_dim else 0
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError("positions must be an int32/int64 tensor with one position per token")
    for name, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, t)
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    num_k_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        sin_offset,
        num_q_heads,
        num_k_heads,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        num_warps=4,
    )
    return q_out, k_out


def rotary_embedding_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, HF's rotate_half formula (out of place), for either table layout."""
    half = q.shape[-1] // 2
    if cos_cache.shape[1] != half:  # full width: [c, c] and [-s, s]
        cos_cache, sin_cache = cos_cache[:, :half], sin_cache[:, half:]
    cos = cos_cache[positions][:, None, :]
    sin = sin_cache[positions][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
