"""The tensor-parallel group: one process per rank, joined over torch.distributed.

Ranks, devices and nodes: a group of `tensor_parallel_size` ranks spans `nnodes` nodes,
each starting its share of the ranks. A rank's global rank is its node's
`tp_rank_offset` plus its `local_rank` on the node (offset `node_rank * ranks_per_node`
when the nodes are alike; set it to place ranks otherwise). `local_rank` picks the device:
on CUDA, rank i of a node runs on `cuda:i`, the i-th GPU in `CUDA_VISIBLE_DEVICES` order
(torch numbers the visible devices in that order); on CPU the ranks share the host. Global
rank 0 owns the socket, the scheduler, the KV block manager and the sampler, so its node
is the only one render servers talk to; every rank joins through rank 0's
`dist_init_addr` (torch's TCP store listens there). Under torchrun, `TPConfig.from_env`
reads the same numbers from its variables.

Backends: NCCL carries the tensors on CUDA (the all-reduces, the logits gather); a second,
gloo group carries host bytes (each step's batch description), so they never go through
the GPU. On CPU one gloo group serves both.

Failure: every collective runs under the group's timeout (`TPConfig.timeout_s`), so a
dead rank makes the others' next collective raise instead of hanging: gloo raises in the
caller (at once when the peer's socket closes, else at the timeout); NCCL's watchdog aborts
the process at the timeout (torch's default `TORCH_NCCL_ASYNC_ERROR_HANDLING`), which is
what a group with a dead rank should do. The same timeout bounds start-up: a rank that
never joins fails `init_tp_group` on the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPConfig:
    """Where this process sits in its TP group; built once at the entry point."""

    tensor_parallel_size: int = 1
    """Ranks in the group: each holds 1/N of the heads, the MLP and the KV cache."""
    rank: int = 0
    """This process's global rank; rank 0 serves the socket and samples."""
    local_rank: int = 0
    """This process's index on its node: its GPU in `CUDA_VISIBLE_DEVICES` order."""
    dist_init_addr: str = "127.0.0.1:29500"
    """HOST:PORT of rank 0's rendezvous, which every rank of every node joins."""
    nnodes: int = 1
    """Nodes the group spans."""
    node_rank: int = 0
    """This node's index among them; node 0 holds rank 0."""
    tp_rank_offset: int = 0
    """Global rank of this node's first rank (its local rank 0)."""
    timeout_s: float = 30.0
    """Seconds a collective or the rendezvous may wait for a peer before failing."""

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if size < 1 or self.nnodes < 1 or self.nnodes > size:
            raise ValueError(f"{size} ranks cannot span {self.nnodes} nodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is outside {self.nnodes} nodes")
        if not 0 <= self.rank < size:
            raise ValueError(f"rank {self.rank} is outside a group of {size}")
        if self.rank != self.tp_rank_offset + self.local_rank:
            raise ValueError(
                f"rank {self.rank} is not tp_rank_offset {self.tp_rank_offset} "
                f"+ local rank {self.local_rank}"
            )
        if self.timeout_s <= 0:
            raise ValueError("the group timeout must be positive")
        self.address()  # refuse a malformed address here, not at the rendezvous

    def address(self) -> tuple[str, int]:
        """`dist_init_addr` as (host, port); an IPv6 host keeps its brackets."""
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"dist_init_addr {self.dist_init_addr!r} is not HOST:PORT")
        return host, int(port)

    def for_local_rank(self, local_rank: int) -> TPConfig:
        """The config of this node's rank `local_rank` (a node starts one per device)."""
        return dataclasses.replace(
            self, local_rank=local_rank, rank=self.tp_rank_offset + local_rank
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], timeout_s: float = 30.0) -> TPConfig | None:
        """The config torchrun describes in its variables (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); None outside torchrun."""
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        per_node = int(environ.get("LOCAL_WORLD_SIZE", str(size)))
        host = environ.get("MASTER_ADDR", "127.0.0.1")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
        return cls(
            tensor_parallel_size=size,
            rank=rank,
            local_rank=local_rank,
            dist_init_addr=f"{host}:{environ.get('MASTER_PORT', '29500')}",
            nnodes=max(1, size // per_node),
            node_rank=int(environ.get("GROUP_RANK", str((rank - local_rank) // per_node))),
            tp_rank_offset=rank - local_rank,
            timeout_s=timeout_s,
        )


@dataclass
class TPGroup:
    """A joined TP group as one rank sees it. A world of 1 has no process groups: every
    collective over it is a no-op (`gpu_worker.distributed.comm`)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    """"nccl" (CUDA), "gloo" (CPU) or "none" (a world of 1)."""
    device_group: dist.ProcessGroup | None = None
    """Carries tensors on `device`: all-reduces and gathers."""
    cpu_group: dist.ProcessGroup | None = None
    """Carries host bytes: the step broadcast (the same group as `device_group` on CPU)."""

    @classmethod
    def single(cls, device: torch.device) -> TPGroup:
        """The group of a worker without tensor parallelism."""
        return cls(rank=0, world_size=1, device=device, backend="none")

    @property
    def is_driver(self) -> bool:
        """Whether this rank drives the others: owns the socket, schedules and samples."""
        return self.rank == 0

    def destroy(self) -> None:
        """Leave the group (idempotent); collectives over it fail afterwards."""
        if self.device_group is None:
            return
        if self.cpu_group is not self.device_group and self.cpu_group is not None:
            dist.destroy_process_group(self.cpu_group)
        dist.destroy_process_group()
        self.device_group = self.cpu_group = None


def init_tp_group(config: TPConfig, device: torch.device) -> TPGroup:
    """Join the group `config` describes, this rank's tensors on `device` (`cuda:i` for
    local rank i, or `cpu`). Blocks until every rank has joined, at most `timeout_s`."""
    if config.tensor_parallel_size == 1:
        return TPGroup.single(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds its communicator to the current device
    host, port = config.address()
    timeout = timedelta(seconds=config.timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        world_size=config.tensor_parallel_size,
        rank=config.rank,
        timeout=timeout,
    )
    device_group = dist.group.WORLD
    cpu_group = device_group
    if backend == "nccl":
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(
        config.rank, config.tensor_parallel_size, device, backend, device_group, cpu_group
    )


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """The device of the node's rank `local_rank`: its GPU on CUDA, the host on CPU."""
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
