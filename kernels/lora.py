"""Batched multi-LoRA (punica-style): many adapters' low-rank updates in one step.

Adapters sit in per-slot stacks: `a_stack [slots, r_max, in]`, `b_stack [slots, out, r_max]`
(zero-padded past each adapter's rank), fp32 `scales [slots]`; each token row names its slot
(int32, -1 = base model, no update). The update of row i with slot s is
`y[i] += scales[s] * (x[i] @ a_stack[s].T) @ b_stack[s].T`, in two launches:

1. `_shrink_kernel`: `t = x @ A.T` per row's slot -> `[rows, r_max]`, rounded to x's dtype
   (as PEFT rounds `lora_A(x)`);
2. `_expand_kernel`: `y[:, col_offset:col_offset + out] += scale * t @ B.T`, so one part of a
   fused projection (q of qkv, up of gate_up) can be targeted in place.

Both kernels have two shapes, picked by the constexpr BLOCK_M:

- BLOCK_M == 1 (BGMV, decode): one program per row, its slot read straight from `row_slots`;
  no sort and no host sync, so the launch fits inside a captured CUDA graph. Each program
  reads its adapter's A and B again, which costs little while they fit in L2 (A of r 16 by
  in 1536 is 48 KB in bf16).
- BLOCK_M == 16 (SGMV, prefill): rows sorted by slot and each slot's run padded to whole
  blocks (`fused_moe.moe_align_block_size`, base rows as an extra group whose blocks are
  skipped), so each program runs `tl.dot` over 16 rows of one adapter.

Not measured on a GPU yet: `BGMV_MAX_ROWS` and the tile sizes are first guesses. A bench
would time both shapes at 1..2048 rows against the base projection's `F.linear` on an H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import check_last_dim_contiguous, check_launchable, dot_precision
from kernels.fused_moe import moe_align_block_size

BGMV_MAX_ROWS = 64
"""Up to this many rows one program per row (no sort); above, rows grouped by slot."""
SGMV_BLOCK_M = 16
"""Rows per SGMV block (tl.dot needs at least 16)."""
MAX_RANK = 256


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    row_ids_ptr,
    block_slot_ptr,
    num_rows,
    in_features,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_tt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    if slot < 0:
        return
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    a = a_ptr + slot * stride_as
    if BLOCK_M == 1:
        row = block.to(tl.int64)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            xv = tl.load(x_ptr + row * stride_xt + ks, mask=k_ok, other=0.0).to(tl.float32)
            av = tl.load(
                a + rs[:, None] * stride_ar + ks[None, :],
                mask=r_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(t_ptr + row * stride_tt + rs, acc.to(t_ptr.dtype.element_ty), mask=r_ok)
    else:
        rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < num_rows
        acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            xt = tl.load(
                x_ptr + rows[:, None] * stride_xt + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            at = tl.load(
                a + rs[None, :] * stride_ar + ks[:, None],
                mask=k_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            acc2 = tl.dot(xt, at, acc2, input_precision=PRECISION)
        tl.store(
            t_ptr + rows[:, None] * stride_tt + rs[None, :],
            acc2.to(t_ptr.dtype.element_ty),
            mask=row_ok[:, None] & r_ok[None, :],
        )


@triton.jit
def _expand_kernel(
    t_ptr,
    b_ptr,
    y_ptr,
    scales_ptr,
    row_ids_ptr,
    block_slot_ptr,
    num_rows,
    out_features,
    rank,
    col_offset,
    stride_tt,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    scale = tl.load(scales_ptr + slot).to(tl.float32)
    bt = tl.load(
        b_ptr + slot * stride_bs + cols[None, :] * stride_bn + rs[:, None],
        mask=r_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    dtype = y_ptr.dtype.element_ty
    if BLOCK_M == 1:
        row = block.to(tl.int64)
        tv = tl.load(t_ptr + row * stride_tt + rs, mask=r_ok, other=0.0).to(tl.float32)
        delta = tl.sum(bt.to(tl.float32) * tv[:, None], axis=0)
        ptrs = y_ptr + row * stride_yt + col_offset + cols
        y = tl.load(ptrs, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + scale * delta).to(dtype), mask=col_ok)
    else:
        rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < num_rows
        tt = tl.load(
            t_ptr + rows[:, None] * stride_tt + rs[None, :],
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        delta2 = tl.dot(tt, bt, input_precision=PRECISION)
        ptrs2 = y_ptr + rows[:, None] * stride_yt + col_offset + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y2 = tl.load(ptrs2, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs2, (y2 + scale * delta2).to(dtype), mask=mask)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def slot_blocks(row_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGMV's row order: row ids sorted by slot, each slot's run padded to SGMV_BLOCK_M with
    `rows` (an invalid id), and each block's slot (-1 for base rows and past the last run).
    Pure torch without a host sync; the same for every projection of a step."""
    num_rows = row_slots.numel()
    base = torch.full_like(row_slots, num_slots)
    groups = torch.where(row_slots < 0, base, row_slots).view(num_rows, 1)
    row_ids, block_slots = moe_align_block_size(groups, num_slots + 1, SGMV_BLOCK_M)
    return row_ids, torch.where(block_slots == num_slots, -1, block_slots)


def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    col_offset: int,
) -> None:
    num_slots, r_max, in_features = a_stack.shape
    out_features = b_stack.shape[1]
    if b_stack.shape != (num_slots, out_features, r_max):
        raise ValueError(f"b_stack must be [{num_slots}, out, {r_max}], got {tuple(b_stack.shape)}")
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
    if y.ndim != 2 or y.shape[0] != x.shape[0] or y.shape[1] < col_offset + out_features:
        raise ValueError(
            f"y {tuple(y.shape)} has no columns {col_offset}..{col_offset + out_features} "
            f"for {x.shape[0]} rows"
        )
    if row_slots.shape != (x.shape[0],) or row_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_slots must be int32/int64 [{x.shape[0]}]")
    if scales.shape != (num_slots,):
        raise ValueError(f"scales must be [{num_slots}], got {tuple(scales.shape)}")
    if r_max > MAX_RANK:
        raise ValueError(f"r_max {r_max} is above {MAX_RANK}")
    if not (x.dtype == y.dtype == a_stack.dtype == b_stack.dtype):
        raise ValueError(
            f"dtypes differ: y {y.dtype}, x {x.dtype}, a {a_stack.dtype}, b {b_stack.dtype}"
        )
    for name, t in (("y", y), ("x", x), ("a_stack", a_stack), ("b_stack", b_stack)):
        check_last_dim_contiguous(name, t)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    col_offset: int = 0,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`y[i, col_offset:col_offset + out] += scales[s] * (x[i] @ a_stack[s].T) @
    b_stack[s].T` for every row i whose slot `s = row_slots[i]` is not -1, in place.
    Shapes as in the module docstring; y may be a view of wider rows (stride(0) is used).
    `blocks` is `slot_blocks(row_slots, slots)` when the caller computed it once for a
    step's projections (only read past BGMV_MAX_ROWS rows)."""
    check_launchable(y, x, a_stack, b_stack, scales, row_slots)
    _check(y, x, a_stack, b_stack, scales, row_slots, col_offset)
    num_rows = x.shape[0]
    num_slots, r_max, in_features = a_stack.shape
    out_features = b_stack.shape[1]
    if num_rows == 0 or num_slots == 0 or out_features == 0:
        return
    if num_rows <= BGMV_MAX_ROWS:
        block_m, row_ids, block_slots, num_blocks = 1, row_slots, row_slots, num_rows
    else:
        block_m = SGMV_BLOCK_M
        row_ids, block_slots = slot_blocks(row_slots, num_slots) if blocks is None else blocks
        num_blocks = block_slots.numel()
    if scales.dtype != torch.float32:
        scales = scales.to(torch.float32)
    t = torch.empty((num_rows, r_max), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    block_r = _block(r_max, MAX_RANK)
    _shrink_kernel[(num_blocks,)](
        x,
        a_stack,
        t,
        row_ids,
        block_slots,
        num_rows,
        in_features,
        r_max,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        t.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=_block(in_features, 128 if block_m == 1 else 64),
        PRECISION=precision,
    )
    block_n = _block(out_features, 64)
    _expand_kernel[(num_blocks, triton.cdiv(out_features, block_n))](
        t,
        b_stack,
        y,
        scales,
        row_ids,
        block_slots,
        num_rows,
        out_features,
        r_max,
        col_offset,
        t.stride(0),
        b_stack.stride(0),
        b_stack.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION=precision,
    )


def lora_add_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    col_offset: int = 0,
) -> None:
    """Plain torch, one row at a time, in place like `lora_add`."""
    out_features = b_stack.shape[1]
    for i, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            t = x[i] @ a_stack[slot].T
            delta = scales[slot] * (t @ b_stack[slot].T)
            part = y[i, col_offset : col_offset + out_features]
            part += delta.to(y.dtype)
