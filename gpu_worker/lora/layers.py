"""LoRA in the model: each target projection adds its rows' adapter updates after the base.

`attach_lora` wraps, in place, the fused projections of a Llama-family model (attention's
`qkv_proj` and `o_proj`, the MLP's `gate_up_proj` and `down_proj`) so that the model files
stay plain and unaware of adapters. A wrapped projection adds, for each of its parts (q, k
and v of `qkv_proj`; gate and up of `gate_up_proj`), `add_lora` on that part's columns of
its output. Which slot each token row uses lives in one `LoRAState`, set by the runner once
per step and read by every wrapped layer; a step without adapter rows sets none and runs
the base model only. MoE experts are not wrapped (the loader refuses adapters of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gpu_worker.distributed.layers import ColumnParallelLinear, RowParallelLinear
from gpu_worker.lora.adapter import LoRAKey
from gpu_worker.lora.batched import add_lora
from gpu_worker.lora.slots import LoRASlots
from gpu_worker.models.llama import MLP, Attention, LlamaForCausalLM


class LoRAState:
    """The current step's row -> slot map, shared by every wrapped projection."""

    def __init__(self, slots: LoRASlots) -> None:
        self.slots = slots
        self.row_slots: torch.Tensor | None = None
        """int32 [tokens], -1 for base rows; None when no row of the step has an adapter."""

    def set_rows(self, row_slots: torch.Tensor | None) -> None:
        """Set the step's slot per token row (flattened like the model's input), or None
        for a base-only step. A CPU tensor of only -1 counts as None, at no device sync."""
        if row_slots is not None and not row_slots.is_cuda and not bool((row_slots >= 0).any()):
            row_slots = None
        self.row_slots = row_slots


class LoRAProjection(nn.Module):
    """A projection whose output gets each row's adapter update, per column part."""

    def __init__(
        self, base: nn.Module, parts: list[tuple[LoRAKey, int, int]], state: LoRAState
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        """(layer, target) with its columns [start, end) in the base's output."""
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        row_slots = self.state.row_slots
        if row_slots is None:
            return y
        slots = self.state.slots
        for key, start, end in self.parts:
            a_stack, b_stack = slots.stacks[key]
            add_lora(y[:, start:end], x, a_stack, b_stack, slots.scales, row_slots)
        return y


def attach_lora(model: nn.Module, slots: LoRASlots) -> LoRAState:
    """Wrap `model`'s target projections (a loaded `LlamaForCausalLM` family model, after
    `build_caches`) to read adapters from `slots`; returns the state the runner sets."""
    if not isinstance(model, LlamaForCausalLM):
        raise NotImplementedError(f"{type(model).__name__} has no LoRA layout")
    state = LoRAState(slots)
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        if isinstance(attn, Attention):
            q, kv = attn.q_size, attn.kv_size
            qkv = [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)]
            _wrap(attn, "qkv_proj", qkv, layer, state)
            _wrap(attn, "o_proj", [("o_proj", 0, None)], layer, state)
        mlp = block.mlp
        if isinstance(mlp, MLP):
            inner = mlp.intermediate_size
            gate_up = [("gate_proj", 0, inner), ("up_proj", inner, 2 * inner)]
            _wrap(mlp, "gate_up_proj", gate_up, layer, state)
            _wrap(mlp, "down_proj", [("down_proj", 0, None)], layer, state)
    return state


def _wrap(
    owner: nn.Module,
    attribute: str,
    parts: Sequence[tuple[str, int, int | None]],
    layer: int,
    state: LoRAState,
) -> None:
    """Replace `owner.<attribute>` by itself wrapped for the parts the slots have stacks
    for (an end of None: to the output's end); leave it if they have none."""
    base = getattr(owner, attribute)
    slots = state.slots
    if isinstance(base, LoRAProjection):
        raise ValueError("attach_lora was already applied to this model")
    if isinstance(base, ColumnParallelLinear | RowParallelLinear):
        # Sharded A and B (input-sharded A for row-parallel layers) are not laid out yet.
        raise NotImplementedError("LoRA with tensor parallelism is not supported yet")
    weight = base.weight
    assert isinstance(weight, torch.Tensor)
    in_features, out_features = weight.shape[1], weight.shape[0]
    wrapped: list[tuple[LoRAKey, int, int]] = []
    for target, start, stop in parts:
        key = (layer, target)
        if key not in slots.stacks:
            continue
        end = out_features if stop is None else stop
        a_stack, b_stack = slots.stacks[key]
        if (a_stack.shape[2], b_stack.shape[1]) != (in_features, end - start):
            raise ValueError(f"layer {layer} {target}: the slots' shapes do not fit the model")
        wrapped.append((key, start, end))
    if wrapped:
        setattr(owner, attribute, LoRAProjection(base, wrapped, state))
