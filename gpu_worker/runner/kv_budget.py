"""How much device memory the KV cache may take: the budget arithmetic, pure and testable.

On CUDA the engine first measures what everything else needs (`gpu_worker.runner.profiling`)
and gives the KV cache what is left under `--gpu-memory-utilization`, as vLLM's
`determine_available_memory` does:

    KV cache = total x utilization
             - memory in use after the profile (weights, buffers it kept, the CUDA context
               and libraries, other processes: the cap covers the whole device)
             - the activation peak of the largest prefill and decode steps (forward,
               logits, sampler)
             - Triton's autotuning workspace (the kernels tune after the cache exists)
             - the CUDA graph pool and static buffers (captured after it too)
             - the runner's persistent block tables (grown while serving)

An explicit `--kv-cache-memory-gb` skips all of it, as on CPU, where there is nothing to read.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30

_FLAGS_TO_CHANGE = (
    "raise --gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs "
    "(activations), lower --cuda-graph-max-batch-size or pass --enforce-eager (graphs), "
    "or give the cache an explicit size with --kv-cache-memory-gb"
)


class KVCacheBudgetError(RuntimeError):
    """The device has no room for even one KV block; the message names the flags to change."""


@dataclass(frozen=True)
class MemoryUse:
    """Device memory (bytes) once the model is loaded and the profile has run."""

    total: int
    """The device's memory."""
    free: int
    """Free after the profile released its temporaries: what stays in use is excluded."""
    torch_reserved: int
    """Held by torch's caching allocator then: the weights and buffers that stay."""
    weights: int
    """The model's parameters and buffers, part of `torch_reserved`."""
    activation_peak: int
    """The most the largest step needed on top of that, forward to sampled tokens."""
    autotune_workspace: int = 0
    """What Triton's autotuner allocates when the backend tunes after the cache exists."""
    graph_pool: int = 0
    """The CUDA graphs' private pool and the graph runner's static buffers."""
    runner_buffers: int = 0
    """What the model runner allocates as sequences arrive (persistent block tables)."""

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def non_torch(self) -> int:
        """CUDA context, libraries (cuBLAS, Triton modules), other processes."""
        return max(0, self.used - self.torch_reserved)

    @property
    def other_torch(self) -> int:
        """Torch memory beyond the weights: buffers the profile kept, allocator rounding."""
        return max(0, self.torch_reserved - self.weights)


@dataclass(frozen=True)
class KVCacheBudget:
    """How many KV blocks to allocate, and where that number came from."""

    num_blocks: int
    bytes_per_block: int
    gpu_memory_utilization: float | None = None
    """The cap applied; None when the size was explicit."""
    memory: MemoryUse | None = None
    """The readings the size came from; None when the size was explicit."""

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def lines(self, kv_dtype: str | None = None) -> list[str]:
        """The budget, one line per term, for the start-up log; `kv_dtype` names the
        cache's element type (--kv-cache-dtype resolved) on the blocks line."""
        blocks = (
            f"{_gib(self.kv_cache_bytes)} -> {self.num_blocks} blocks "
            f"of {self.bytes_per_block / (1 << 20):.2f} MiB"
        )
        if kv_dtype is not None:
            blocks += f" ({kv_dtype})"
        m, util = self.memory, self.gpu_memory_utilization
        if m is None or util is None:
            return [f"KV cache (explicit --kv-cache-memory-gb, or the CPU default): {blocks}"]
        rows = [
            ("total device memory", m.total, ""),
            (f"cap (--gpu-memory-utilization {util:g})", int(m.total * util), ""),
            ("- weights", m.weights, ""),
            ("- other torch memory", m.other_torch, " (buffers kept, allocator rounding)"),
            ("- non-torch memory", m.non_torch, " (CUDA context, libraries, other processes)"),
            ("- activation peak", m.activation_peak, " (largest prefill / decode + sampler)"),
            ("- autotune workspace", m.autotune_workspace, ""),
            ("- CUDA graph pool (estimate)", m.graph_pool, ""),
            ("- runner buffers (block tables)", m.runner_buffers, ""),
        ]
        out = ["GPU memory budget for the KV cache:"]
        out += [f"  {name:<38} {_gib(value)}{note}" for name, value, note in rows]
        out.append(f"  {'= KV cache':<38} {blocks}")
        return out


def plan_kv_cache(
    bytes_per_block: int,
    *,
    kv_cache_memory_gb: float | None,
    gpu_memory_utilization: float,
    memory: MemoryUse | None,
) -> KVCacheBudget:
    """The number of KV blocks: `kv_cache_memory_gb` when given, else what `memory` leaves
    under `gpu_memory_utilization` of the device. Raises KVCacheBudgetError when that is
    not even one block."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if kv_cache_memory_gb is not None:
        if kv_cache_memory_gb <= 0:
            raise ValueError(f"--kv-cache-memory-gb must be positive, got {kv_cache_memory_gb}")
        return KVCacheBudget(
            max(1, int(kv_cache_memory_gb * GIB) // bytes_per_block), bytes_per_block
        )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    if memory is None:
        raise ValueError("sizing the KV cache needs memory readings or --kv-cache-memory-gb")
    cap = int(memory.total * gpu_memory_utilization)
    reserved = (
        memory.activation_peak
        + memory.autotune_workspace
        + memory.graph_pool
        + memory.runner_buffers
    )
    available = cap - memory.used - reserved
    if available < bytes_per_block:
        raise KVCacheBudgetError(
            f"no GPU memory left for the KV cache: the cap is {_gib(cap)} "
            f"({gpu_memory_utilization:g} of {_gib(memory.total)}), {_gib(memory.used)} is "
            f"in use (weights {_gib(memory.weights)}, non-torch {_gib(memory.non_torch)}), "
            f"and activations need {_gib(memory.activation_peak)}, autotuning "
            f"{_gib(memory.autotune_workspace)}, CUDA graphs {_gib(memory.graph_pool)}, "
            f"block tables {_gib(memory.runner_buffers)}; "
            f"{_FLAGS_TO_CHANGE}"
        )
    return KVCacheBudget(
        available // bytes_per_block,
        bytes_per_block,
        gpu_memory_utilization=gpu_memory_utilization,
        memory=memory,
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
