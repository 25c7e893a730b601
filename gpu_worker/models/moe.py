"""The sparse mixture-of-experts feed-forward block that Mixtral and Qwen3-MoE share.

A router picks each token's top-k experts from a softmax over its logits; each expert is a
SwiGLU MLP. The experts' weights are stacked, `[experts, 2 * inner, hidden]` for gate/up
(gate rows first, like `MLP.gate_up_proj`) and `[experts, hidden, inner]` for down, which is
both transformers 5's in-memory layout and what the grouped kernels read. The arithmetic is
the layer ops' `fused_moe` (torch: a matmul pair per expert with tokens; Triton:
kernels/fused_moe.py).

Checkpoints store one matrix per expert (`mlp.experts.3.gate_proj.weight`) or, in a GGUF
file, one per projection for all experts; `stack_expert_weights` turns either into the
stacked tensors as they stream past, holding at most one layer's stack at a time. Lazy
checkpoint tensors (a tensor-parallel rank's safetensors slices) stack lazily instead: the
rank's shard hook indexes the stack, and only the rows or columns it names are read from
each expert's tensor, so no rank ever holds a layer's whole stack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.llama import MLP
from gpu_worker.models.weights import TensorSource
from gpu_worker.ops.layer_ops import LayerOps


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[tokens, experts]` -> fp32 weights and expert ids `[tokens, top_k]`:
    top-k of the fp32 softmax, rescaled to sum to one if `renormalize` (transformers'
    MixtralTopKRouter always, Qwen3MoeTopKRouter by `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """The stacked SwiGLU weights of every expert of one layer, `inner_size` rows of gate
    and of up each (a tensor-parallel rank's experts hold a slice of the model's rows)."""

    def __init__(self, num_experts: int, hidden_size: int, inner_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner_size))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        """`[tokens, hidden]` through each token's routed experts, weighted and summed."""
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, HF's name) plus experts; a drop-in for `MLP` in a decoder layer."""

    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Logits in the model dtype, softmax in fp32: transformers' rounding.
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids, self.ops)


def moe_or_dense_mlp(config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
    """`LlamaForCausalLM.build_mlp` for MoE families: experts where the config says so."""
    return SparseMoeBlock(config, ops) if config.is_moe_layer(layer) else MLP(config, ops)


_EXPERT_TENSOR = re.compile(r"^(.*\.experts)(?:\.(\d+))?\.(gate_proj|up_proj|down_proj)\.weight$")


_PARTS = ("gate_proj", "up_proj", "down_proj")


class _PendingLayer:
    """A layer's expert tensors still to come, each (projection, expert) exactly once."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.missing = {(part, e) for part in _PARTS for e in range(num_experts)}

    def claim(self, part: str, expert: int | None) -> None:
        """Mark one expert's matrix (`expert` given) or all experts' as arrived."""
        experts = range(self.num_experts) if expert is None else [expert]
        keys = {(part, e) for e in experts}
        if not keys <= self.missing:
            raise ValueError(f"expert tensor {part} {expert} given twice or out of range")
        self.missing -= keys


class _LayerStack(_PendingLayer):
    """One layer's stacked expert tensors, copied in as the checkpoint's parts arrive."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None

    def add(self, part: str, expert: int | None, source: TensorSource) -> None:
        """Copy one expert's matrix (`expert` given) or all experts' (`[experts, ...]`)."""
        self.claim(part, expert)
        tensor = source if isinstance(source, torch.Tensor) else source[:]
        rows, cols = tensor.shape[-2:]
        if part == "down_proj":
            if self.down is None:
                self.down = tensor.new_empty((self.num_experts, rows, cols))
            target = self.down
        else:
            if self.gate_up is None:
                self.gate_up = tensor.new_empty((self.num_experts, 2 * rows, cols))
            # Gate rows first, then up: the layout `MLP.gate_up_proj` and the kernels use.
            half = slice(0, rows) if part == "gate_proj" else slice(rows, 2 * rows)
            target = self.gate_up[:, half]
        if expert is None:
            target.copy_(tensor)
        else:
            target[expert].copy_(tensor)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.gate_up is not None and self.down is not None
        return self.gate_up, self.down


def _source_shape(source: Any) -> tuple[int, ...]:
    """A checkpoint tensor's shape: a tensor's, or a safetensors slice's `get_shape()`."""
    shape = getattr(source, "shape", None)
    return tuple(shape if shape is not None else source.get_shape())


class _Projection:
    """One projection of every expert of a layer, unread: the checkpoint's one
    `[experts, rows, cols]` tensor, or its `[rows, cols]` tensor of each expert."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.all: TensorSource | None = None
        self.each: dict[int, TensorSource] = {}

    def add(self, expert: int | None, source: TensorSource) -> None:
        if expert is None:
            self.all = source
        else:
            self.each[expert] = source

    @property
    def rows(self) -> int:
        return _source_shape(self.all if self.all is not None else self.each[0])[-2]

    def read(self, experts: slice, rows: slice, cols: slice) -> torch.Tensor:
        """`[experts, rows, cols]` of the stack, reading only those from each tensor."""
        if self.all is not None:
            return self.all[experts, rows, cols]
        return torch.stack([self.each[e][rows, cols] for e in range(self.num_experts)[experts]])


def _basic_slices(index: Any) -> tuple[slice, slice, slice]:
    """A stack's index as a slice of each of its 3 dims, the ones left out whole."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 3 or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
        raise TypeError(f"a lazy expert stack takes up to 3 contiguous slices, not {index!r}")
    slices: list[slice] = [*parts, *[slice(None)] * (3 - len(parts))]
    return slices[0], slices[1], slices[2]


class _LazyStack:
    """A stacked expert parameter over unread checkpoint tensors (a `TensorSource`):
    `gate_up_proj` (each expert's gate rows, then its up rows) or `down_proj`. Indexing it
    with slices reads just that part of each projection's tensors."""

    def __init__(self, projections: tuple[_Projection, ...]) -> None:
        self.projections = projections

    def __getitem__(self, index: Any) -> torch.Tensor:
        experts, rows, cols = _basic_slices(index)
        sizes = [projection.rows for projection in self.projections]
        start, stop, _ = rows.indices(sum(sizes))
        parts, offset = [], 0
        for projection, size in zip(self.projections, sizes, strict=True):
            first, end = max(start - offset, 0), min(stop - offset, size)
            if first < end:
                parts.append(projection.read(experts, slice(first, end), cols))
            offset += size
        if not parts:
            return self.projections[0].read(experts, slice(0, 0), cols)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class _LazyLayerStack(_PendingLayer):
    """One layer's expert tensors kept unread until the layer is complete."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)
        self.projections = {part: _Projection(num_experts) for part in _PARTS}

    def add(self, part: str, expert: int | None, source: TensorSource) -> None:
        self.claim(part, expert)
        self.projections[part].add(expert, source)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = _LazyStack((self.projections["gate_proj"], self.projections["up_proj"]))
        down = _LazyStack((self.projections["down_proj"],))
        # Lazy, as the checkpoint's tensors were: only a shard hook indexes them.
        return cast(torch.Tensor, gate_up), cast(torch.Tensor, down)


def stack_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the checkpoint through, with each layer's expert matrices replaced by the two
    stacked tensors `{prefix}.experts.gate_up_proj` and `.down_proj`, yielded once the
    layer is complete. Expert names are `{prefix}.experts.{e}.{gate,up,down}_proj.weight`
    (one expert) or `{prefix}.experts.{gate,up,down}_proj.weight` (`[experts, ...]`).

    Tensors are copied into the stack as they arrive; lazy ones (`TensorSource`s that are
    not tensors) are kept unread and the stacks yielded are lazy too, read by slicing."""
    pending: dict[str, _LayerStack | _LazyLayerStack] = {}
    for name, tensor in weights:
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, part = match.groups()
        if prefix not in pending:
            eager = isinstance(tensor, torch.Tensor)
            pending[prefix] = (_LayerStack if eager else _LazyLayerStack)(num_experts)
        stack = pending[prefix]
        stack.add(part, None if expert is None else int(expert), tensor)
        if not stack.missing:
            del pending[prefix]
            gate_up, down = stack.stacked()
            yield f"{prefix}.gate_up_proj", gate_up
            yield f"{prefix}.down_proj", down
    for prefix, stack in pending.items():
        some = sorted(stack.missing)[:4]
        raise ValueError(
            f"checkpoint lacks {len(stack.missing)} expert tensors of {prefix}: {some}"
        )
