"""The KV cache's memory: how many blocks fit on the device, and the tensors that hold them.

Layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0
= keys, 1 = values). Cache slot `s` is block `s // block_size`, offset `s % block_size`.
The block ids themselves are handed out by `gpu_worker.core.kv_cache`, which never
touches these tensors. The size is `gpu_worker.runner.kv_budget`'s arithmetic over what
`gpu_worker.runner.profiling` measured on CUDA.
"""

from __future__ import annotations

import logging

import torch

from gpu_worker.core.config import EngineConfig
from gpu_worker.models.config import ModelConfig
from gpu_worker.runner.kv_budget import KVCacheBudget, MemoryUse, plan_kv_cache

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GB = 1.0
"""The cache on CPU when `kv_cache_memory_gb` is not given (no free-memory probe there)."""

_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `--kv-cache-dtype name`: auto is the model's dtype
    (fp32 on CPU by default, so the default cache is exact)."""
    if name == "auto":
        return model_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name}: use auto, {', '.join(_KV_DTYPES)}")
    return _KV_DTYPES[name]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V for every layer of one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def model_kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """`kv_cache_bytes_per_block` of this model."""
    mc = model_config
    return kv_cache_bytes_per_block(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, dtype)


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


def size_kv_cache(
    model_config: ModelConfig,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    memory: MemoryUse | None,
) -> KVCacheBudget:
    """The cache's size in blocks of `dtype` (the resolved `--kv-cache-dtype`: a 16-bit
    cache fits twice the blocks of an fp32 one): `config.kv_cache_memory_gb`, else on CPU
    the fixed default, else what the profiled `memory` leaves under
    `gpu_memory_utilization`; logged line by line, the dtype named."""
    kv_gb = config.kv_cache_memory_gb
    if kv_gb is None and device.type != "cuda":
        kv_gb = CPU_DEFAULT_KV_CACHE_GB
    budget = plan_kv_cache(
        model_kv_bytes_per_block(model_config, config.block_size, dtype),
        kv_cache_memory_gb=kv_gb,
        gpu_memory_utilization=config.gpu_memory_utilization,
        memory=memory,
    )
    for line in budget.lines(kv_dtype=_dtype_name(dtype)):
        logger.info("%s", line)
    return budget


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
