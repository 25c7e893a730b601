"""LoRA in the model: each target projection adds its rows' adapter updates after the base.

`attach_lora` wraps, in place, the fused projections of a Llama-family model (attention's
`qkv_proj` and `o_proj`, the MLP's `gate_up_proj` and `down_proj`) so that the model files
stay plain and unaware of adapters. A wrapped projection adds, for each of its parts (q, k
and v of `qkv_proj`; gate and up of `gate_up_proj`), its adapters' update on that part's
columns of its output. Which slot each token row uses lives in one `LoRAState`, planned by
the runner once per step (`set_rows`) and read by every wrapped layer; a step without
adapter rows sets none and runs the base model only, and on the torch path a step skips
the targets none of its adapters adapts. MoE experts are not wrapped (the loader refuses
adapters of them).

Tensor parallelism: a column-parallel part (q, k, v, gate, up) keeps A whole and B's rows
of the rank's output rows; a row-parallel layer (o, down) keeps A's columns of the rank's
input columns and B whole, and adds its partial update before the layer's all-reduce, so
one all-reduce sums both. `lora_targets` says each rank's shapes and shards for its slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from gpu_worker.distributed.comm import all_reduce_
from gpu_worker.distributed.layers import ColumnParallelLinear, RowParallelLinear
from gpu_worker.lora.adapter import LoRAKey
from gpu_worker.lora.batched import LoRABatch
from gpu_worker.lora.slots import LoRASlots, TargetShard
from gpu_worker.models.llama import MLP, Attention, LlamaForCausalLM


class LoRAState:
    """The current step's planned rows, shared by every wrapped projection."""

    def __init__(self, slots: LoRASlots, *, use_kernels: bool | None = None) -> None:
        self.slots = slots
        self.use_kernels = use_kernels
        """Force the Triton kernels on (the interpreter's CPU tests) or off; None: on CUDA."""
        self.batch: LoRABatch | None = None
        """None when no row of the step has an adapter."""
        self.active: frozenset[LoRAKey] | None = None
        """The targets the step's adapters adapt; None: all (the kernels' path, which
        never reads the rows back, and so may be captured in a CUDA graph)."""

    @property
    def row_slots(self) -> torch.Tensor | None:
        """The step's slot per row, or None for a base-only step."""
        return None if self.batch is None else self.batch.row_slots

    def set_rows(self, row_slots: torch.Tensor | None) -> None:
        """Plan the step: its slot per token row (int32/int64, flattened like the model's
        input, -1 for base rows), or None for a base-only step. On the host a step of only
        -1 plans nothing; on the kernels' path nothing is read back (no device sync)."""
        if row_slots is None:
            self.batch, self.active = None, None
            return
        self.batch = LoRABatch.plan(row_slots, self.slots.scales, use_kernels=self.use_kernels)
        if self.batch is None or self.batch.groups is None and self.batch.whole_batch_slot is None:
            self.active = None
        else:
            self.active = self.slots.targets_of(self.batch.present)


@dataclass(frozen=True)
class LoRATarget:
    """One adaptable part of a projection on this rank."""

    key: LoRAKey
    columns: slice
    """Where the part sits in the projection's (local) output."""
    in_features: int
    """The projection's (local) input width."""
    shard: TargetShard

    @property
    def shape(self) -> tuple[int, int]:
        """The slots' (in, out) for this part."""
        return self.in_features, self.columns.stop - self.columns.start


class LoRAProjection(nn.Module):
    """A projection whose output gets each row's adapter update, per column part."""

    def __init__(self, base: nn.Module, parts: list[LoRATarget], state: LoRAState) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        row_parallel = base if isinstance(base, RowParallelLinear) else None
        y: torch.Tensor = base(x) if row_parallel is None else row_parallel.local_forward(x)
        batch, active = self.state.batch, self.state.active
        if batch is not None:
            stacks = self.state.slots.stacks
            batch.add_parts(
                y,
                x,
                [
                    (part.columns, *stacks[part.key])
                    for part in self.parts
                    if active is None or part.key in active
                ],
            )
        if row_parallel is not None:
            y = all_reduce_(row_parallel.group, y)
        return y


def lora_targets(model: nn.Module) -> dict[LoRAKey, LoRATarget]:
    """Every part `attach_lora` can adapt in `model` (a loaded `LlamaForCausalLM` family
    model, TP-parallelized or not), with this rank's shapes: `LoRASlots(max_loras, rank,
    {k: t.shape ...}, device, dtype, {k: t.shard ...})` holds what this rank reads."""
    return {part.key: part for _, _, parts in _projections(model) for part in parts}


def attach_lora(model: nn.Module, slots: LoRASlots) -> LoRAState:
    """Wrap `model`'s target projections (after `build_caches`) to read adapters from
    `slots` (built over `lora_targets(model)`); returns the state the runner sets."""
    state = LoRAState(slots)
    for owner, attribute, parts in list(_projections(model)):
        wrapped = [part for part in parts if part.key in slots.stacks]
        for part in wrapped:
            a_stack, b_stack = slots.stacks[part.key]
            if (a_stack.shape[2], b_stack.shape[1]) != part.shape:
                raise ValueError(f"{part.key}: the slots' shapes do not fit the model")
        if wrapped:
            setattr(owner, attribute, LoRAProjection(getattr(owner, attribute), wrapped, state))
    return state


def _projections(model: nn.Module) -> Iterator[tuple[nn.Module, str, list[LoRATarget]]]:
    """(owner, attribute, parts) of each adaptable projection."""
    if not isinstance(model, LlamaForCausalLM):
        raise NotImplementedError(f"{type(model).__name__} has no LoRA layout")
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        if isinstance(attn, Attention):
            q, kv = attn.q_size, attn.kv_size
            qkv = {"q_proj": q, "k_proj": kv, "v_proj": kv}
            yield attn, "qkv_proj", _parts(attn.qkv_proj, layer, qkv)
            yield attn, "o_proj", _parts(attn.o_proj, layer, {"o_proj": None})
        mlp = block.mlp
        if isinstance(mlp, MLP):
            inner = mlp.intermediate_size
            gate_up = {"gate_proj": inner, "up_proj": inner}
            yield mlp, "gate_up_proj", _parts(mlp.gate_up_proj, layer, gate_up)
            yield mlp, "down_proj", _parts(mlp.down_proj, layer, {"down_proj": None})


def _parts(base: nn.Module, layer: int, sizes: Mapping[str, int | None]) -> list[LoRATarget]:
    """The parts of projection `base`: `sizes` names its targets in output order with
    their dense widths (None: the whole output); a parallel layer says its own shard."""
    if isinstance(base, LoRAProjection):
        raise ValueError("attach_lora was already applied to this model")
    weight = base.weight
    assert isinstance(weight, torch.Tensor)
    out_features, in_features = weight.shape
    if isinstance(base, ColumnParallelLinear):
        return [
            LoRATarget((layer, t), base.local_rows(i), in_features, TargetShard(out_rows=rows))
            for i, (t, rows) in enumerate(zip(sizes, base.part_rows, strict=True))
        ]
    if isinstance(base, RowParallelLinear):
        (target,) = sizes
        shard = TargetShard(in_columns=base.in_columns)
        return [LoRATarget((layer, target), slice(0, out_features), in_features, shard)]
    parts, start = [], 0
    for target, size in sizes.items():
        end = out_features if size is None else start + size
        parts.append(LoRATarget((layer, target), slice(start, end), in_features, TargetShard()))
        start = end
    return parts
