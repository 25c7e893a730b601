"""The worker's registered LoRA adapters: name -> checked adapter in CPU memory, and the
slots the runner fills from them.

Registering reads and checks an adapter once (`load_peft_adapter`) and keeps its fp32
weights in CPU memory (a few MB for a small model's rank-16 adapter), so making it
resident later is a copy into a slot, never a disk read. At most `max_loras` are resident
(`LoRASlots`, least recently used out); the rest stay registered.

Two kinds of path: `--lora-modules` are the operator's own (any path, the same checks of
the files), runtime loads (`LoadLoRA`) must resolve inside `--lora-root`
(`resolve_adapter_dir`). Every refusal is a `LoRAError` carrying its HTTP status.

Under tensor parallelism only rank 0 has a registry. Its slot copies and unregistrations
since the last step (`LoRARegistry.take_sync`) travel with each step, and each follower's
`LoRAMirror` repeats them on its own slots (its shard of each adapter, read from the same
path), so the step's per-row slots name the same adapters on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from gpu_worker.lora.adapter import LoRAAdapter, load_peft_adapter
from gpu_worker.lora.paths import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    InvalidLoRAError,
    LoRAError,
    LoRANotFoundError,
    resolve_adapter_dir,
)
from gpu_worker.lora.slots import LoRASlots
from gpu_worker.models.config import ModelConfig


class LoRAConflictError(LoRAError):
    """The name is registered already, or requests still run under it (409)."""

    status = 409


class SlotFill(msgspec.Struct, array_like=True, frozen=True):
    """Adapter `name`, read from `path`, was copied into `slot`."""

    name: str
    path: str
    slot: int


class LoRASync(msgspec.Struct, array_like=True, frozen=True):
    """What changed in rank 0's registry and slots since the last step, in order: the
    adapters unregistered, then the slot copies of the step."""

    unregistered: list[str] = msgspec.field(default_factory=list)
    fills: list[SlotFill] = msgspec.field(default_factory=list)


class LoRARegistry:
    """The adapters a worker can serve and the slots they are made resident in."""

    def __init__(self, slots: LoRASlots, model_config: ModelConfig, lora_root: Path | None):
        self.slots = slots
        self._model_config = model_config
        self._lora_root = lora_root
        self._adapters: dict[str, LoRAAdapter] = {}
        self._paths: dict[str, Path] = {}
        """Each registered adapter's directory (resolved), for followers to read."""
        self._unregistered: list[str] = []
        """Names unregistered since the last `take_sync`."""

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    @property
    def registered(self) -> list[str]:
        """Every adapter a request may name, in registration order."""
        return list(self._adapters)

    @property
    def resident(self) -> list[str]:
        """The adapters in the slots now, least recently used first."""
        return self.slots.resident

    def register_runtime(self, name: str, path: str) -> LoRAAdapter:
        """Register the adapter at `path` (relative to `--lora-root`, or absolute inside it)."""
        self._check_free(name)
        return self._register(name, resolve_adapter_dir(path, self._lora_root))

    def register_trusted(self, name: str, path: Path) -> LoRAAdapter:
        """Register an operator's adapter (`--lora-modules`): any directory on this disk."""
        self._check_free(name)
        if not path.is_dir():
            raise LoRANotFoundError(f"no adapter directory at {str(path)!r}")
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            if not (path / file).is_file():
                raise LoRANotFoundError(f"the adapter at {str(path)!r} has no {file}")
        return self._register(name, path)

    def unregister(self, name: str) -> None:
        """Forget adapter `name` and empty its slot."""
        if self._adapters.pop(name, None) is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        del self._paths[name]
        self.slots.remove(name)
        if name not in self._unregistered:
            self._unregistered.append(name)

    def acquire(self, names: Iterable[str]) -> Mapping[str, int]:
        """Make a step's adapters (registered ones) resident; each one's slot."""
        return self.slots.acquire(names, self._adapters.__getitem__)

    def take_sync(self) -> LoRASync:
        """The unregistrations and slot copies since the last call: what a tensor-parallel
        rank 0 sends with a step, after the step's `acquire`."""
        unregistered, self._unregistered = self._unregistered, []
        fills = [
            SlotFill(name, str(self._paths[name]), slot) for name, slot in self.slots.take_loads()
        ]
        return LoRASync(unregistered, fills)

    def _check_free(self, name: str) -> None:
        if name in self._adapters:
            raise LoRAConflictError(f"a LoRA adapter named {name!r} is already loaded")

    def _register(self, name: str, directory: Path) -> LoRAAdapter:
        adapter = load_peft_adapter(name, directory, self._model_config, self.slots.max_lora_rank)
        # The slots cover what this model's wrapped projections can adapt: an adapter of
        # any other (layer, target) would fail only at its first request.
        if not set(adapter.weights) <= set(self.slots.stacks):
            raise InvalidLoRAError(f"adapter {name!r} adapts projections this model lacks")
        self._adapters[name] = adapter
        self._paths[name] = directory.resolve()
        return adapter


class LoRAMirror:
    """A tensor-parallel follower's slots, kept rank 0's by its `LoRASync`s.

    Each adapter is read once from the path rank 0 registered it from (trusted: rank 0
    checked it) and kept in CPU memory while registered, so a refill after an eviction is
    a copy; `fill` slices this rank's shard. An unregistered adapter is forgotten, so a
    later one of the same name is read afresh. The stale copy left in the slot of an
    unregistered adapter is never read: no row names the slot until rank 0 fills it again.
    """

    def __init__(self, slots: LoRASlots, model_config: ModelConfig) -> None:
        self.slots = slots
        self._model_config = model_config
        self._adapters: dict[str, tuple[str, LoRAAdapter]] = {}
        """Name -> (the path it was read from, the adapter)."""

    def apply(self, sync: LoRASync) -> None:
        """Repeat rank 0's unregistrations, then its slot copies."""
        for name in sync.unregistered:
            self._adapters.pop(name, None)
        for fill in sync.fills:
            cached = self._adapters.get(fill.name)
            if cached is None or cached[0] != fill.path:
                adapter = load_peft_adapter(
                    fill.name, Path(fill.path), self._model_config, self.slots.max_lora_rank
                )
                cached = self._adapters[fill.name] = (fill.path, adapter)
            self.slots.fill(cached[1], fill.slot)
