"""The resident adapters: `max_loras` slots of preallocated stacks, filled and evicted LRU.

Each adaptable (layer, target) has one `a_stack [max_loras, max_lora_rank, in]` and one
`b_stack [max_loras, out, max_lora_rank]`, allocated once: their addresses never change, so
a captured CUDA graph keeps reading the current adapters. An adapter copied into slot s
fills `[s, :rank]` of its A and `[s, :, :rank]` of its B and zeroes the rest of the slot,
including every target it lacks, so `add_lora` over the full `max_lora_rank` adds exactly
its update. Under tensor parallelism a rank's stacks hold its shard (`TargetShard`: A's
input columns for a row-parallel layer, B's output rows for a column-parallel one), sliced
from the whole adapter at the copy. Copies go through the stacks' device stream, after the
steps queued before them, so overwriting a slot never races a step still reading it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from gpu_worker.lora.adapter import LoRAAdapter, LoRAKey, TargetShapes


@dataclass(frozen=True)
class TargetShard:
    """The part of one target's A and B a tensor-parallel rank holds (whole when None)."""

    in_columns: slice | None = None
    """A's columns: the row-parallel layer's input columns on this rank."""
    out_rows: slice | None = None
    """B's rows: the column-parallel part's output rows on this rank."""


class TooManyLoRAsError(RuntimeError):
    """A batch needs more distinct adapters than there are slots."""


class LoRASlots:
    """`max_loras` adapter slots over the (layer, target) shapes of one model."""

    def __init__(
        self,
        max_loras: int,
        max_lora_rank: int,
        shapes: TargetShapes,
        device: torch.device,
        dtype: torch.dtype,
        shards: Mapping[LoRAKey, TargetShard] | None = None,
    ) -> None:
        """`shapes` are this rank's (in, out) per target, `shards` how they slice the
        adapters' whole A and B (none: every target whole, as without TP)."""
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.stacks: dict[LoRAKey, tuple[torch.Tensor, torch.Tensor]] = {
            key: (
                torch.zeros(max_loras, max_lora_rank, in_features, device=device, dtype=dtype),
                torch.zeros(max_loras, out_features, max_lora_rank, device=device, dtype=dtype),
            )
            for key, (in_features, out_features) in shapes.items()
        }
        """(layer, target) -> (a_stack, b_stack)."""
        self.shards: Mapping[LoRAKey, TargetShard] = dict(shards or {})
        self.scales = torch.zeros(max_loras, device=device, dtype=torch.float32)
        """Each slot's scale; an empty slot's is 0."""
        self._targets_of_slot: list[frozenset[LoRAKey]] = [frozenset()] * max_loras
        """The (layer, target) pairs each slot's adapter adapts (the rest are zeros)."""
        self._slot_of: OrderedDict[str, int] = OrderedDict()
        """Resident adapter -> its slot, least recently used first."""
        self.num_loads = 0
        """Adapters copied into a slot."""
        self.num_evictions = 0
        """Resident adapters pushed out to make room for another."""
        self._loads: dict[int, str] = {}
        """Slot -> the adapter last copied into it since the last `take_loads` (bounded by
        the slots, whether or not anyone takes them)."""

    @property
    def resident(self) -> list[str]:
        """The adapters in the slots, least recently used first."""
        return list(self._slot_of)

    def slot_of(self, name: str) -> int | None:
        """The slot holding adapter `name`, or None."""
        return self._slot_of.get(name)

    def targets_of(self, slots: Iterable[int]) -> frozenset[LoRAKey]:
        """The (layer, target) pairs the adapters in `slots` adapt: a step's projections
        outside them add nothing and are skipped."""
        return frozenset().union(*(self._targets_of_slot[slot] for slot in slots))

    def activate(self, adapter: LoRAAdapter) -> int:
        """Copy `adapter` into a slot (its own if resident, since its weights may have been
        reloaded; else a free one, else the least recently used one's) and return it."""
        return self._activate(adapter, pinned=frozenset())

    def acquire(
        self, names: Iterable[str], load: Callable[[str], LoRAAdapter]
    ) -> Mapping[str, int]:
        """Make every adapter a step needs resident, loading the missing ones with `load`;
        returns each one's slot. The step's adapters are pinned while others load, so one
        never evicts another of the same step; all become the most recently used."""
        needed = list(dict.fromkeys(names))
        if len(needed) > self.max_loras:
            raise TooManyLoRAsError(
                f"a step needs {len(needed)} adapters but there are {self.max_loras} slots"
            )
        pinned = frozenset(needed)
        slots: dict[str, int] = {}
        for name in needed:
            slot = self._slot_of.get(name)
            if slot is None:
                slot = self._activate(load(name), pinned)
            self._slot_of.move_to_end(name)
            slots[name] = slot
        return slots

    def take_loads(self) -> list[tuple[str, int]]:
        """The (adapter, slot) copies made since the last call, in order: what a tensor-
        parallel leader sends its followers with the step, so their slots mirror its own."""
        loads, self._loads = self._loads, {}
        return [(name, slot) for slot, name in loads.items()]

    def fill(self, adapter: LoRAAdapter, slot: int) -> None:
        """Copy `adapter` into `slot` itself, replacing whatever it held: a TP follower
        repeating its leader's `take_loads` (its own shard of the same adapter)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is not one of the {self.max_loras} slots")
        for name, held in list(self._slot_of.items()):
            if held == slot or name == adapter.name:
                del self._slot_of[name]
                if held != slot:
                    self._clear(held)
        self._check(adapter)
        self._copy_in(adapter, slot)
        self._slot_of[adapter.name] = slot
        self.num_loads += 1

    def remove(self, name: str) -> bool:
        """Empty adapter `name`'s slot (an unload); False if it was not resident."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            return False
        self._clear(slot)
        return True

    def _check(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_lora_rank:
            raise ValueError(f"rank {adapter.rank} exceeds the slots' {self.max_lora_rank}")
        unknown = set(adapter.weights) - set(self.stacks)
        if unknown:
            raise ValueError(f"adapter {adapter.name!r} targets projections the model lacks")

    def _activate(self, adapter: LoRAAdapter, pinned: frozenset[str]) -> int:
        self._check(adapter)
        slot = self._slot_of.get(adapter.name)
        if slot is None:
            slot = self._free_slot(pinned)
        self._copy_in(adapter, slot)
        self._loads[slot] = adapter.name
        self._slot_of[adapter.name] = slot
        self._slot_of.move_to_end(adapter.name)
        self.num_loads += 1
        return slot

    def _free_slot(self, pinned: frozenset[str]) -> int:
        used = set(self._slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next((name for name in self._slot_of if name not in pinned), None)
        if victim is None:
            raise TooManyLoRAsError(f"all {self.max_loras} slots hold adapters of this step")
        self.num_evictions += 1
        return self._slot_of.pop(victim)

    def _copy_in(self, adapter: LoRAAdapter, slot: int) -> None:
        rank = adapter.rank
        for key, (a_stack, b_stack) in self.stacks.items():
            pair = adapter.weights.get(key)
            if pair is None:
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                continue
            a, b = pair
            shard = self.shards.get(key)
            if shard is not None and shard.in_columns is not None:
                a = a[:, shard.in_columns]
            if shard is not None and shard.out_rows is not None:
                b = b[shard.out_rows]
            a_stack[slot, :rank].copy_(a)
            a_stack[slot, rank:].zero_()
            b_stack[slot, :, :rank].copy_(b)
            b_stack[slot, :, rank:].zero_()
        self.scales[slot] = adapter.scale
        self._targets_of_slot[slot] = frozenset(adapter.weights)

    def _clear(self, slot: int) -> None:
        for a_stack, b_stack in self.stacks.values():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
        self.scales[slot] = 0.0
        self._targets_of_slot[slot] = frozenset()
