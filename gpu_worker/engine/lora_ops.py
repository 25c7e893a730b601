"""Loading and unloading LoRA adapters at run time (/v1/load_lora_adapter and
/v1/unload_lora_adapter), and registering the --lora-modules at start-up."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from gpu_worker.core.config import EngineConfig
from gpu_worker.core.sequence import Sequence
from gpu_worker.engine.rank import RankModel, attach_lora_slots
from gpu_worker.lora.layers import LoRAState
from gpu_worker.lora.manager import LoRAConflictError, LoRARegistry
from gpu_worker.lora.paths import InvalidLoRAError, LoRAError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAOpResult:
    """How `Engine.load_lora` or `unload_lora` went: an HTTP-style status (200 done, 400
    invalid or refused, 404 not found, 409 already loaded or in use) and what to tell."""

    status: int
    message: str

    @property
    def ok(self) -> bool:
        return self.status == 200


def build_lora(config: EngineConfig, rank: RankModel) -> tuple[LoRARegistry, LoRAState] | None:
    """The LoRA slots wrapped into the model and the registry over them, holding the
    --lora-modules (a bad one fails the start); None when LoRA is off."""
    attached = attach_lora_slots(config, rank)
    if attached is None:
        return None
    slots, state = attached
    registry = LoRARegistry(slots, rank.model_config, config.lora_root)
    for name, path in config.lora_module_paths().items():
        try:
            registry.register_trusted(name, path)
        except LoRAError as exc:  # a ValueError, as every bad engine argument is
            raise ValueError(f"--lora-modules {name}: {exc.message}") from exc
    return registry, state


def load_lora(registry: LoRARegistry | None, name: str, path: str) -> LoRAOpResult:
    """Register the adapter at `path`, which must resolve inside --lora-root."""
    try:
        _on(registry).register_runtime(name, path)
    except LoRAError as exc:
        return LoRAOpResult(exc.status, exc.message)
    logger.info("registered LoRA adapter %s", name)
    return LoRAOpResult(200, f"LoRA adapter {name!r} added")


def unload_lora(
    registry: LoRARegistry | None, name: str, requests: Iterable[Sequence]
) -> LoRAOpResult:
    """Forget adapter `name`; refused (409) while `requests` (those running or waiting)
    use it, whose next step would find no adapter."""
    try:
        on = _on(registry)
        in_use = sum(seq.lora_name == name for seq in requests)
        if in_use:
            raise LoRAConflictError(
                f"LoRA adapter {name!r} is in use by {in_use} request(s): unload it after they end"
            )
        on.unregister(name)
    except LoRAError as exc:
        return LoRAOpResult(exc.status, exc.message)
    logger.info("unregistered LoRA adapter %s", name)
    return LoRAOpResult(200, f"LoRA adapter {name!r} removed")


def _on(registry: LoRARegistry | None) -> LoRARegistry:
    if registry is None:
        raise InvalidLoRAError("LoRA is off: start the worker with --enable-lora")
    return registry
