"""What every rank of an engine builds: its model (or its shard of it) and its runner.

One path for all: an engine without tensor parallelism is rank 0 of a world of one, and
the ranks of a TP group each build the same steps from the same `EngineConfig`:

1. `load_rank_model`: the model on the rank's device, sharded over the group's ranks;
   with LoRA on, `attach_lora_slots` wraps it over the rank's adapter slots (its shard of
   each adapter; the same slots on every rank).
2. `build_runner`: the KV cache, sized by a profiling run on CUDA (every rank profiles its
   own device) or by the configured size, then the same number of blocks on every rank,
   the smallest any rank can afford (a MIN all-reduce: rank 0's block ids index every
   rank's cache); the runner over it, the attention autotuners, and the decode CUDA
   graphs, whose captured forward holds the rank's all-reduces.

Both are collectives at TP > 1 (the profiling forwards, the block count, the graphs'
warm-up and capture): every rank calls them in the same order with the same shapes.
What differs is what a step does after the forward (`post_forward` of the profile): rank
0 samples and scores prompt logprobs; a follower takes part only in the logits gathers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gpu_worker.attention.backend import (
    AttentionBackend,
    get_attention_backend,
    resolve_backend_name,
)
from gpu_worker.core.config import EngineConfig
from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.sharding import local_heads
from gpu_worker.loader import load_model
from gpu_worker.lora.layers import LoRAState, attach_lora, lora_targets
from gpu_worker.lora.slots import LoRASlots
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.ops.cpu_precision import wants_fast
from gpu_worker.ops.layer_ops import get_layer_ops
from gpu_worker.runner.device import resolve_dtype
from gpu_worker.runner.kv_budget import MemoryUse
from gpu_worker.runner.kv_caches import (
    allocate_kv_caches,
    resolve_kv_cache_dtype,
    size_kv_cache,
)
from gpu_worker.runner.model_runner import AdapterRows, AdapterSlots, ModelRunner
from gpu_worker.runner.profiling import (
    CudaMemoryProbe,
    PostForward,
    ProfileShapes,
    profile_memory,
)
from shared.model_source import ModelSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankModel:
    """A rank's loaded model: `model_config` is the full model's, `local_config` the
    rank's share of it (its KV heads: what its cache holds)."""

    model: CausalLM
    model_config: ModelConfig
    local_config: ModelConfig
    attn_backend: AttentionBackend
    backend_name: str
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    """The KV cache's element type: `--kv-cache-dtype`, auto being `dtype`."""


def load_rank_model(config: EngineConfig, source: ModelSource, group: TPGroup) -> RankModel:
    """Load `source` on `group.device`: this rank's shard when the group has several."""
    device = group.device
    dtype = resolve_dtype(config.dtype, device)
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    backend_name = resolve_backend_name(config.attention_backend, device)
    attn_backend = get_attention_backend(backend_name, query_dtype=dtype)
    model, mc = load_model(
        source,
        device,
        dtype,
        attn_backend,
        layer_ops=get_layer_ops(backend_name),
        gguf_kernels=config.cpu_gguf_kernels,
        max_model_len=config.max_model_len,
        tp_group=group if group.world_size > 1 else None,
    )
    if wants_fast(config.cpu_precision, device, dtype):
        count = model.attach_fast_copies()
        logger.info("--cpu-precision fast: %d weights multiply in bf16", count)
    heads = local_heads(mc.num_heads, mc.num_kv_heads, group.world_size, group.rank)
    local = replace(mc, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)
    return RankModel(model, mc, local, attn_backend, backend_name, device, dtype, kv_cache_dtype)


def attach_lora_slots(config: EngineConfig, rank: RankModel) -> tuple[LoRASlots, LoRAState] | None:
    """With `enable_lora`, the rank's `max_loras` adapter slots (this rank's shapes and
    shards) and the model wrapped over them; None when LoRA is off. Before `build_runner`:
    the KV cache is sized with the slots already allocated."""
    if not config.enable_lora:
        return None
    try:
        targets = lora_targets(rank.model)
    except NotImplementedError as exc:  # a family without the Llama layout
        raise ValueError(f"--enable-lora: {exc}") from exc
    slots = LoRASlots(
        config.max_loras,
        config.max_lora_rank,
        {key: target.shape for key, target in targets.items()},
        rank.device,
        rank.dtype,
        {key: target.shard for key, target in targets.items()},
    )
    return slots, attach_lora(rank.model, slots)


def decode_graph_batch_size(
    config: EngineConfig, device: torch.device, backend_name: str
) -> int | None:
    """The largest decode batch, in rows, to capture in CUDA graphs, or None for none:
    graphs need CUDA and the Triton backend (the torch backend plans each step on the
    host), and `enforce_eager` turns them off. With speculative decoding a verify step is
    a decode step of 1 + k rows per sequence, so the graphs go up to 1 + K times the
    sequences."""
    if device.type != "cuda" or backend_name != "triton" or config.enforce_eager:
        return None
    speculative = config.speculative()
    rows_per_seq = 1 if speculative is None else 1 + speculative.num_speculative_tokens
    max_rows = config.max_num_seqs * rows_per_seq
    max_batch = config.cuda_graph_max_batch_size or min(max_rows, 512)
    if max_batch < 1:
        raise ValueError(f"cuda_graph_max_batch_size must be positive, got {max_batch}")
    return min(max_batch, max_rows)


def build_runner(
    config: EngineConfig,
    rank: RankModel,
    group: TPGroup,
    post_forward: PostForward,
    lora: tuple[AdapterSlots | None, AdapterRows] | None = None,
) -> ModelRunner:
    """The rank's runner: its KV cache (sized on CUDA by a profiling run whose steps end
    in `post_forward`), the autotuners run, its LoRA adapters (`ModelRunner.use_lora`:
    rank 0's registry, none on a follower) and the decode graphs captured."""
    max_model_len = config.context_limit(rank.model_config.max_position_embeddings)
    graph_batch_size = decode_graph_batch_size(config, rank.device, rank.backend_name)
    memory = _profile_memory(config, rank, max_model_len, graph_batch_size, post_forward)
    local = rank.local_config
    budget = size_kv_cache(local, config, rank.device, rank.kv_cache_dtype, memory)
    num_blocks = _smallest_over_group(budget.num_blocks, group)
    kv_caches = allocate_kv_caches(
        local.num_layers,
        num_blocks,
        config.block_size,
        local.num_kv_heads,
        local.head_dim,
        rank.kv_cache_dtype,
        rank.device,
    )
    runner = ModelRunner(rank.model, rank.attn_backend, kv_caches, config.block_size, rank.device)
    if lora is not None:
        runner.use_lora(*lora)
    # Every autotuner runs now, on the real cache, so that no request waits for one;
    # before the graphs, whose capture must not tune.
    rank.attn_backend.tune(
        local,
        kv_caches[0],
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    if graph_batch_size is not None:
        runner.capture_decode_graphs(graph_batch_size, max_model_len)
    return runner


def _profile_memory(
    config: EngineConfig,
    rank: RankModel,
    max_model_len: int,
    graph_batch_size: int | None,
    post_forward: PostForward,
) -> MemoryUse | None:
    """On CUDA without an explicit `kv_cache_memory_gb`, what the largest steps, the
    autotuner and the decode graphs need beside the KV cache (a profiling run); None
    elsewhere: CPU keeps its fixed default and pays no profiling forward at start-up."""
    if rank.device.type != "cuda" or config.kv_cache_memory_gb is not None:
        return None
    shapes = ProfileShapes(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=config.block_size,
        graph_batch_size=graph_batch_size,
    )
    return profile_memory(
        rank.model,
        rank.local_config,
        shapes,
        post_forward,
        CudaMemoryProbe(rank.device),
        dtype=rank.dtype,
        device=rank.device,
        kv_cache_dtype=rank.kv_cache_dtype,
        autotunes=rank.backend_name == "triton",
    )


def _smallest_over_group(num_blocks: int, group: TPGroup) -> int:
    """The fewest blocks any rank of `group` can hold (`num_blocks` in a world of one)."""
    if group.world_size == 1:
        return num_blocks
    smallest = torch.tensor([num_blocks], dtype=torch.int64, device=group.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=group.device_group)
    return int(smallest.item())
