"""Device detection and NVML readings (KV cache sizing is `gpu_worker.runner.kv_caches`).

NVML is optional: on CPU nodes (and GPUs without the driver library) every reading is
None and nothing is logged beyond one debug line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when a device is visible, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is visible")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; use auto, cuda or cpu")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU, unless `--dtype` says otherwise."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return dtypes[name]


@dataclass(frozen=True)
class GpuReading:
    """One NVML sample; every field None where NVML is absent."""

    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization: float | None = None


class Nvml:
    """NVML for one CUDA device; quiet no-op where it cannot be loaded."""

    def __init__(self, device: torch.device) -> None:
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as exc:  # NVML missing or driver mismatch: readings stay None
            logger.debug("NVML unavailable: %s", exc)
            self._handle = None

    def read(self) -> GpuReading:
        if self._handle is None:
            return GpuReading()
        try:
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        except Exception:
            return GpuReading()
        return GpuReading(
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            memory_free_bytes=int(memory.free),
            utilization=float(rates.gpu) / 100.0,
        )
