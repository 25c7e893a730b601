"""Bodies of vLLM's runtime LoRA routes (/v1/load_lora_adapter, /v1/unload_lora_adapter)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LoadLoRAAdapterRequest(BaseModel):
    """Load an adapter from a directory on the workers' disks (inside their --lora-root)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(default="", max_length=128)
    lora_path: str = Field(default="", max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """Unload an adapter by name."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(default="", max_length=128)
    lora_int_id: int | None = None
    """vLLM's engine-internal id; accepted and ignored (duet names adapters only)."""
