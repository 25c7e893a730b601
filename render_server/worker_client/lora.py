"""LoRA adapters as the render tier knows them: the `--lora-modules` it declares, and the
load and unload operations it runs on its workers.

An adapter's weights never pass through the render tier: a `LoadLoRA` names a path on the
worker's own disk (inside the worker's `--lora-root`), and the worker answers each
operation with one `LoRAResult`. The pool (render_server.worker_client.pool) sends the
operations and matches the answers; this module holds what it sends and what it reports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapter the render server declares (`--lora-modules`): every worker that
    connects is asked to load it."""

    name: str
    """What clients pass as `model` to select it."""
    path: str
    """Its directory on the workers' disks (inside their --lora-root)."""
    base_model_name: str | None = None
    """vLLM's field; the adapter's parent in /v1/models is always the served model."""


class _LoRAModuleJson(BaseModel):
    """The JSON form of one --lora-modules value, as vLLM reads it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` value in either of vLLM's forms: `name=path`, or the JSON
    object `{"name": ..., "path": ..., "base_model_name": ...}`; else a ValueError."""
    text = text.strip()
    if "=" in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        module = _LoRAModuleJson(name=name.strip(), path=path.strip())
    else:
        try:
            module = _LoRAModuleJson.model_validate(json.loads(text))
        except json.JSONDecodeError:
            raise ValueError(f"invalid JSON format for --lora-modules: {text!r}") from None
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"invalid fields for --lora-modules {text!r}: {problems}") from None
    return LoRAModule(module.name, module.path, module.base_model_name)


@dataclass(frozen=True, slots=True)
class LoRAOutcome:
    """One worker's answer to a load or unload (or why none came)."""

    address: str
    ok: bool
    status: int
    """The worker's: 200 done, 400 refused, 404 not found, 409 already loaded or in use;
    503 when the worker was lost, 504 when it did not answer in time."""
    message: str
