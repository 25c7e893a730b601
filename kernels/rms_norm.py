"""RMSNorm, and residual-add fused with RMSNorm, computed in fp32.

Matches `gpu_worker.models.llama.RMSNorm` op for op: `h = x.float()`,
`h * rsqrt(mean(h^2) + eps)`, rounded to x's dtype, then times the weight. The fused form first
adds the residual in x's dtype (as `x + residual` in torch would) and normalizes that sum, so a
decoder layer reads and writes its hidden state once per norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import check_last_dim_contiguous, check_launchable

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    tensors = (x, weight) if residual is None else (x, residual, weight)
    check_launchable(*tensors)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds {MAX_HIDDEN} (one row per program)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    x2d = x.reshape(-1, hidden)
    r2d = x2d if residual is None else residual.reshape(-1, hidden)
    check_last_dim_contiguous("residual", r2d)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # what `weight * h` gives in torch
    out = torch.empty(x2d.shape, dtype=out_dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(x2d)
    if x2d.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d,
            r2d,
            weight,
            out,
            out if new_residual is None else new_residual,
            x2d.stride(0),
            r2d.stride(0),
            out.stride(0),
            out.stride(0) if new_residual is None else new_residual.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    out = out.view(x.shape)
    return out, None if new_residual is None else new_residual.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x `[..., hidden]`; weight `[hidden]`."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual`; returns `(rms_norm(new_residual), new_residual)`.
    Both outputs are new tensors; the inputs are left as they were."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, exactly as `gpu_worker.models.llama.RMSNorm`."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the residual add in x's dtype, then `rms_norm_ref`."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
