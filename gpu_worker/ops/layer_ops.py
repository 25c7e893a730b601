"""The model's elementwise ops behind one interface: RMSNorm (plain and fused with the
residual add), rotary embedding, SiLU-and-mul and the experts of a sparse MoE layer.

`TorchLayerOps` is plain torch, op for op what transformers computes, except RMSNorm on CPU
fp32 where duet's CPU extension is built: `cpu_ops.rms_norm` is one pass instead of six aten
ops (61 calls a step; timed in bench/RESULTS.md, CPU kernels), equal to `F.rms_norm` up to
summation order. `TritonLayerOps` runs duet's kernels (kernels/rms_norm.py,
rotary.py, activation.py): one pass over memory each where torch makes several, and fewer
launches per layer, which is what a decode step of a small model on a GPU pays for. The
engine pairs them with the attention backend of the same name; the model code is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_worker.ops import cpu_ops


@dataclass(frozen=True)
class RotaryTables:
    """What every layer's rotation of one step reads, prepared once per forward."""

    positions: torch.Tensor
    """[tokens] int64."""
    cos: torch.Tensor
    """Full-width tables ([cos, cos] and [-sin, sin]): per token `[tokens, 1, head_dim]`
    (torch ops, gathered once) or per position `[max_positions, head_dim]` (Triton)."""
    sin: torch.Tensor


class LayerOps(Protocol):
    """Elementwise ops of a Llama-family layer."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`new_residual = residual + x`; returns `(rms_norm(new_residual), new_residual)`."""
        ...

    def rotary_tables(
        self, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
    ) -> RotaryTables: ...

    def rotate(
        self, qk: torch.Tensor, num_q_heads: int, tables: RotaryTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk `[tokens, q_heads + kv_heads, head_dim]` (a view of the fused QKV output) ->
        rotated q `[tokens, q_heads, head_dim]` and k `[tokens, kv_heads, head_dim]`."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[tokens, 2 * inner]` (gate then up) -> `silu(gate) * up` `[tokens, inner]`."""
        ...

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """SwiGLU experts over routed tokens: x `[tokens, hidden]`, stacked expert weights
        w13 `[experts, 2 * inner, hidden]` (gate rows then up rows) and w2
        `[experts, hidden, inner]`, each token's experts `topk_ids [tokens, k]` and fp32
        weights -> `sum_k weight * expert(x)` `[tokens, hidden]`."""
        ...


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`LayerOps.fused_moe` in torch: the (token, expert) pairs are sorted by expert so that
    each expert with tokens runs once, as two matmuls over its rows; the weighted rows are
    summed back per token in fp32 (transformers' order: by expert, then by token)."""
    num_tokens, k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    # One host sync for the group sizes: a loop over experts needs them anyway.
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // k
    rows = x.index_select(0, token_of)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = slice(start, start + count)
            gate, up = F.linear(rows[part], w13[expert]).chunk(2, dim=-1)
            out[part] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    weighted = out.float() * topk_weights.flatten().index_select(0, order)[:, None]
    summed = weighted.new_zeros((num_tokens, x.shape[1])).index_add_(0, token_of, weighted)
    return summed.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] by full-width per-token tables [tokens, 1, head_dim]
    (`[cos, cos]`, `[-sin, sin]`): the two halves of head_dim are the rotated pairs, and the
    products are the ones HF forms (`-x2 * sin` there, `x2 * -sin` here), bit for bit."""
    h = x.float()
    out = h * cos + h.roll(x.shape[-1] // 2, dims=-1) * sin
    return out.to(x.dtype)


class TorchLayerOps:
    """Plain torch, rounding where HF rounds."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.is_contiguous() and cpu_ops.available(x):
                return cpu_ops.rms_norm(x, weight, eps)
            # In fp32 it gives the formula below to the bit.
            return F.rms_norm(x, weight.shape, weight, eps)
        # HF rounds the normalized value to the model dtype before scaling; the fused
        # kernel rounds once at the end, a last-bit difference in a quarter of bf16 values.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            x.dtype == residual.dtype == torch.float32
            and x.shape == residual.shape
            and x.is_contiguous()
            and residual.is_contiguous()
            and cpu_ops.available(x)
        ):
            return cpu_ops.add_rms_norm(x, residual, weight, eps)
        new_residual = residual + x
        return self.rms_norm(new_residual, weight, eps), new_residual

    def rotary_tables(
        self, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
    ) -> RotaryTables:
        # Gathered once per step, broadcasting over heads, instead of once per layer.
        cos = cos_cache.index_select(0, positions)[:, None, :]
        sin = sin_cache.index_select(0, positions)[:, None, :]
        return RotaryTables(positions, cos, sin)

    def rotate(
        self, qk: torch.Tensor, num_q_heads: int, tables: RotaryTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q and k rotate in one go: one op each over all heads.
        if cpu_ops.rotatable(qk, tables.cos):
            out = cpu_ops.rotate_qk(qk, tables.cos, tables.sin)
        else:
            out = apply_rotary(qk, tables.cos, tables.sin)
        q, k = out.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return moe_experts(x, w13, w2, topk_weights, topk_ids)


class TritonLayerOps:
    """duet's Triton kernels (CUDA, or the interpreter in CPU tests)."""

    def __init__(self) -> None:
        # Imported here, not with the module: Triton picks compile or interpret at
        # decoration time, and CPU tests set TRITON_INTERPRET first.
        from kernels.activation import silu_and_mul
        from kernels.fused_moe import fused_moe
        from kernels.rms_norm import fused_add_rms_norm, rms_norm
        from kernels.rotary import rotary_embedding

        self._rms_norm = rms_norm
        self._fused_add_rms_norm = fused_add_rms_norm
        self._rotary_embedding = rotary_embedding
        self._silu_and_mul = silu_and_mul
        self._fused_moe = fused_moe

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fused_add_rms_norm(x, residual, weight, eps)

    def rotary_tables(
        self, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
    ) -> RotaryTables:
        return RotaryTables(positions, cos_cache, sin_cache)  # the kernel gathers by position

    def rotate(
        self, qk: torch.Tensor, num_q_heads: int, tables: RotaryTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = qk.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
        return self._rotary_embedding(q, k, tables.positions, tables.cos, tables.sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return self._fused_moe(x, w13, w2, topk_weights, topk_ids)


def get_layer_ops(backend_name: str) -> LayerOps:
    """The ops that go with an attention backend: Triton's kernels with Triton attention."""
    return TritonLayerOps() if backend_name == "triton" else TorchLayerOps()
