"""Fused MoE: the SwiGLU experts of a sparse MoE layer as two grouped GEMMs.

The (token, expert) pairs of the step are sorted by expert and each expert's group padded to
a multiple of BLOCK_M (`moe_align_block_size`, in torch, without a host sync: the padded
length is bounded by `pairs + experts * (BLOCK_M - 1)`), so that every row block of the
sorted order belongs to one expert. Then:

1. `_gate_up_kernel`: per row block, the expert's gate and up rows against the gathered token
   rows, SiLU(gate) * up in the epilogue -> `[pairs, inner]` in the model dtype;
2. `_down_kernel`: per row block, that against the expert's down matrix, scaled by the
   routing weight -> `[pairs, hidden]` in fp32, summed over each token's k pairs in torch.

Blocks past the real groups have no expert (-1) and return at once; padding rows point past
the last pair and are masked. Weights are `gpu_worker.models.moe`'s stacked layout: w13
`[experts, 2 * inner, hidden]` (gate rows, then up rows), w2 `[experts, hidden, inner]`.

Not measured yet, and one fixed tile config (no autotune). A bench would time one layer on
a GPU against `moe_experts` (the torch path) at decode (1..256 tokens) and prefill (2k-8k)
sizes for Mixtral-8x7B (8 experts, top-2, hidden 4096, inner 14336) and Qwen3-30B-A3B (128
experts, top-8, hidden 2048, inner 768), then tune BLOCK_M (16/32/64) and BLOCK_N/BLOCK_K:
few rows per expert at decode want a small BLOCK_M, prefill a large one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import check_last_dim_contiguous, check_launchable, dot_precision

BLOCK_M = 16
"""Rows per block (a power of two, at least 16 for tl.dot). Decode steps route a few rows to
each expert, so a small block wastes little on padding."""


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted pair ids, each expert's run padded to `block_m` with `pairs` (an invalid id),
    and each row block's expert (-1 past the last group). Pair `p` is token `p // k`'s
    `p % k`-th choice."""
    flat = topk_ids.flatten().to(torch.int64)
    pairs = flat.numel()
    # scatter_add, not bincount: CUDA's bincount reads the max back, a host sync that a
    # CUDA-graph capture of the decode step cannot contain.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    expert_sorted = flat.index_select(0, order)
    rank = torch.arange(pairs, device=flat.device) - starts.index_select(0, expert_sorted)
    dest = (padded_end - padded).index_select(0, expert_sorted) + rank
    max_padded = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[dest] = order
    block_start = torch.arange(0, max_padded, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    top_k,
    hidden,
    inner,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    token = pair // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inner
    w = w_ptr + expert * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b_mask = k_ok[:, None] & col_ok[None, :]
        b_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        b_up = tl.load(
            w + (inner + cols[None, :]) * stride_wn + ks[:, None], mask=b_mask, other=0.0
        )
        gate = tl.dot(a, b_gate, gate, input_precision=PRECISION)
        up = tl.dot(a, b_up, up, input_precision=PRECISION)
    # Round as the torch path does: the projection, then silu(gate), in the model dtype.
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(
        out_ptr + pair[:, None] * stride_ot + cols[None, :],
        (act * up).to(dtype),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inner,
    stride_ht,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inner
        a = tl.load(
            h_ptr + pair[:, None] * stride_ht + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w + cols[None, :] * stride_wn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    # The expert's output rounds to the model dtype before the routing weight scales it.
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    tl.store(
        out_ptr + pair[:, None] * stride_ot + cols[None, :],
        acc * scale[:, None],
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x `[tokens, hidden]`, w13 `[experts, 2 * inner, hidden]`, w2 `[experts, hidden, inner]`,
    fp32 `topk_weights` and `topk_ids` `[tokens, k]` -> `sum_k weight * expert(x)`
    `[tokens, hidden]` in x's dtype (`gpu_worker.ops.layer_ops.LayerOps.fused_moe`)."""
    check_launchable(x, w13, w2, topk_weights, topk_ids)
    num_experts, two_inner, hidden = w13.shape
    inner = two_inner // 2
    num_tokens, top_k = topk_ids.shape
    if x.shape != (num_tokens, hidden) or w2.shape != (num_experts, hidden, inner):
        raise ValueError(
            f"shapes differ: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights ({w13.dtype}, {w2.dtype}) must be x's dtype {x.dtype}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(name, t)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros((num_tokens, hidden))
    out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    sorted_ids, block_expert = moe_align_block_size(topk_ids, num_experts, BLOCK_M)
    num_blocks = block_expert.numel()
    weights = topk_weights.to(torch.float32).flatten().contiguous()
    act = torch.empty((num_pairs, inner), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    block_n, block_k = _block(inner, 64), _block(hidden, 64)
    _gate_up_kernel[(num_blocks, triton.cdiv(inner, block_n))](
        x,
        w13,
        act,
        sorted_ids,
        block_expert,
        num_pairs,
        top_k,
        hidden,
        inner,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
    )
    block_n, block_k = _block(hidden, 64), _block(inner, 64)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act,
        w2,
        out,
        weights,
        sorted_ids,
        block_expert,
        num_pairs,
        hidden,
        inner,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Plain torch, one (token, choice) pair at a time through its expert's weights."""
    inner = w13.shape[1] // 2
    gate_up = torch.einsum("th,tkih->tki", x, w13[topk_ids])
    gate, up = gate_up[..., :inner], gate_up[..., inner:]
    out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2[topk_ids])
    return (out.float() * topk_weights[..., None].float()).sum(dim=1).to(x.dtype)
