"""A step's sampled ids on their way to the host, while they stay on the device.

Async scheduling runs step N+1 before the host has read step N's tokens: N+1's decode
rows take their input ids from N's samples on the device (`SampledTokens.device_ids`),
and the host reads them one step later (`host_ids`). On CUDA, the ids leave in one
non-blocking copy into a pinned buffer, with an event recorded after it: reading waits
for that event only, not for the step launched since. Two pinned buffers take turns, as
one step's ids are read while the next step's are copied. Logprob tensors, when a step
has them, travel the same way (a pinned copy each, before the event).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpu_worker.sampling.sampler import SamplerOutput


@dataclass
class SampledTokens:
    """One step's sampled ids, by row, and its logprobs, readable on the host once the
    copies are done."""

    device_ids: torch.Tensor
    """[n] int64 on the device: what the next step's inputs read."""
    row_of: Mapping[str, int]
    """Request id -> its row in `device_ids`."""
    output: SamplerOutput
    """The sampler's output, its logprob tensors on the host (or on their way)."""
    _host: torch.Tensor
    _event: torch.cuda.Event | None

    def host_ids(self) -> list[int]:
        """The ids in row order; waits for their copy, nothing else."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class SampledTokenCopy:
    """The pinned buffers a device's sampled ids are copied into, step after step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._on_cuda = device.type == "cuda"
        self._buffers = [_pinned(256, self._on_cuda), _pinned(256, self._on_cuda)]
        self._turn = 0

    def start(self, output: SamplerOutput, row_of: Mapping[str, int]) -> SampledTokens:
        """Start moving `output` to the host; its ids stay usable on the device."""
        ids = output.sampled
        if not self._on_cuda:
            return SampledTokens(ids, row_of, output, ids, None)
        n = ids.shape[0]
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < n:
            buffer = self._buffers[self._turn] = _pinned(max(n, 2 * buffer.shape[0]), True)
        self._turn ^= 1
        host = buffer[:n]
        host.copy_(ids, non_blocking=True)
        on_host = SamplerOutput(
            sampled=ids,
            logprobs=_to_host(output.logprobs),
            ranks=_to_host(output.ranks),
            top_ids=_to_host(output.top_ids),
            top_logprobs=_to_host(output.top_logprobs),
            num_top=output.num_top,
        )
        event = torch.cuda.Event()
        event.record()
        return SampledTokens(ids, row_of, on_host, host, event)


def _pinned(n: int, on_cuda: bool) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, pin_memory=on_cuda)


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    # A non-blocking copy to the CPU lands in pinned memory that torch allocates.
    return None if tensor is None else tensor.to("cpu", non_blocking=True)
