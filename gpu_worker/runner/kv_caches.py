"""The KV cache's memory: how many blocks fit on the device, and the tensors that hold them.

Layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0
= keys, 1 = values). Cache slot `s` is block `s // block_size`, offset `s % block_size`.
The block ids themselves are handed out by `gpu_worker.core.kv_cache`, which never
touches these tensors.
"""

from __future__ import annotations

import torch

from gpu_worker.core.config import EngineConfig
from gpu_worker.models.config import ModelConfig

CPU_DEFAULT_KV_CACHE_GB = 1.0
"""The cache on CPU when `kv_cache_memory_gb` is not given (no free-memory probe there)."""


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V for every layer of one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_kv_blocks(
    device: torch.device,
    bytes_per_block: int,
    *,
    kv_cache_memory_gb: float | None,
    gpu_memory_utilization: float,
) -> int:
    """How many KV blocks fit: an explicit budget, or on CUDA the free memory after the
    weights, kept under `gpu_memory_utilization` of the total."""
    if kv_cache_memory_gb is not None:
        return max(1, int(kv_cache_memory_gb * (1 << 30)) // bytes_per_block)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * gpu_memory_utilization) - used
        # Leave room for activations of the largest batch.
        budget -= 1 << 30
        if budget <= 0:
            raise RuntimeError("no GPU memory left for the KV cache; lower the model size")
        return max(1, budget // bytes_per_block)
    return max(1, (4 << 30) // bytes_per_block)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def create_kv_caches(
    model_config: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Size the cache for this model on this device (after its weights are loaded, so that
    CUDA's free memory already excludes them) and allocate it."""
    mc = model_config
    kv_gb = config.kv_cache_memory_gb
    if kv_gb is None and device.type != "cuda":
        kv_gb = CPU_DEFAULT_KV_CACHE_GB
    per_block = kv_cache_bytes_per_block(
        mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
    )
    num_blocks = num_kv_blocks(
        device,
        per_block,
        kv_cache_memory_gb=kv_gb,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    return allocate_kv_caches(
        mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, dtype, device
    )
