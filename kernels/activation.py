"""SiLU-and-mul: the SwiGLU activation over the fused gate/up projection.

`gpu_worker.models.llama.MLP` computes `gate, up = gate_up_proj(x).chunk(2, dim=-1)` and then
`F.silu(gate) * up`: the gate is the FIRST half of the last dimension, up the second.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import check_last_dim_contiguous, check_launchable

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inner, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    row = x_ptr + token * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inner + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the torch model does.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[..., 2 * inner]` (gate then up) -> `silu(gate) * up` `[..., inner]`."""
    check_launchable(x)
    check_last_dim_contiguous("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate and up), got {x.shape[-1]}")
    inner = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2d.shape[0], inner), dtype=x.dtype, device=x.device)
    if x2d.shape[0] and inner:
        block = min(MAX_BLOCK, triton.next_power_of_2(inner))
        grid = (x2d.shape[0], triton.cdiv(inner, block))
        _silu_and_mul_kernel[grid](
            x2d, out, x2d.stride(0), out.stride(0), inner, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inner)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch, exactly as the model's MLP."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
