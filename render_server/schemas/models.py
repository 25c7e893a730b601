"""Bodies of /v1/models (OpenAI list shape) and of the admin endpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelInfo(BaseModel):
    """One served model, as OpenAI's /v1/models lists it (plus vLLM's extra fields)."""

    id: str
    """The name clients pass as `model`."""
    object: Literal["model"] = "model"
    created: int
    """Unix time the server started serving it."""
    owned_by: str = "duet"
    root: str | None
    """The underlying model's own name (before --served-model-name); for a LoRA adapter
    its path, when known."""
    parent: str | None = None
    """For a LoRA adapter, the served model it applies to."""
    max_model_len: int


class ModelList(BaseModel):
    """The /v1/models response."""

    object: Literal["list"] = "list"
    data: list[ModelInfo]


class HealthResponse(BaseModel):
    """The /health response: the process is up and serving HTTP."""

    status: Literal["ok"] = "ok"


class VersionResponse(BaseModel):
    """The /version response."""

    version: str
