"""Host values -> device tensor, without a host<->device sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(
    values: Sequence[int | float | bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list on `device`: pinned and non-blocking on CUDA, so the step's only sync
    stays the sampler's final read of the sampled ids."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
