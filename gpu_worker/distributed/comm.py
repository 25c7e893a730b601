"""The collectives a TP group runs each step, each over a `TPGroup`.

Every rank must call each of them in the same order (they are collectives); over a world
of 1 each returns its input without touching torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_worker.distributed.group import TPGroup


def all_reduce_(group: TPGroup, tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place on every rank; returns it. The one
    communication of a row-parallel layer and of the vocabulary-parallel embedding."""
    if group.world_size > 1:
        dist.all_reduce(tensor, group=group.device_group)
    return tensor


def broadcast_step(group: TPGroup, payload: bytes | None) -> bytes:
    """Rank 0's `payload` (one step's batch description, encoded by the caller) on every
    rank: rank 0 passes it, the others pass None and receive it. One broadcast of the
    length, then one of the bytes, over the host group (never through the GPU)."""
    if group.is_driver:
        if payload is None:
            raise ValueError("rank 0 must pass the step's payload")
    elif payload is not None:
        raise ValueError("only rank 0 passes a payload; the others receive it")
    if group.world_size == 1:
        assert payload is not None
        return payload
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group.cpu_group)
    length = int(size.item())
    if length == 0:
        return b""
    if payload is not None:
        # frombuffer wants a writable buffer; one copy of a step's few kilobytes.
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(length, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group.cpu_group)
    return payload if payload is not None else data.numpy().tobytes()


def gather_to_rank0(group: TPGroup, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Every rank's `tensor` (one shape on all ranks) concatenated along `dim` on rank 0,
    in rank order; None on the other ranks."""
    if group.world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group.world_size)] if group.is_driver else None
    dist.gather(tensor, parts, dst=0, group=group.device_group)
    return torch.cat(parts, dim=dim) if parts is not None else None
