"""The profiling run: the largest steps the scheduler can hand the runner, run once on dummy
inputs before the KV cache is sized, to measure the memory they need (vLLM's `profile_run`).

The steps: the largest prefill (the token budget spread over as many sequences as one step
holds, and in one chunk), the largest decode batch, and the decode forward of the largest
CUDA-graph batch (its activations become the graph pool). Every query sits at the end of a
`max_model_len` context, the most any attention kernel reads. After the forward, what a real
step does next runs too (`PostForward`: the engine's sampler and prompt-logprob scoring),
so the peak covers logits and sampling buffers.

Attention reads and writes a small temporary cache, one tensor every layer shares (the
values are garbage either way): block tables cycle over its blocks, so sequences of any
length fit in it. It is released before the real cache is sized.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.runner.cuda_graphs import batch_size_buckets
from gpu_worker.runner.kv_budget import MemoryUse
from gpu_worker.runner.kv_caches import allocate_kv_caches, kv_cache_bytes_per_block

logger = logging.getLogger(__name__)

PostForward = Callable[[torch.Tensor, torch.Tensor], None]
"""What a step runs after the forward, given the sampling rows' fp32 logits [n, >= vocab]
and the step's hidden states [num_tokens, hidden]."""

PROFILE_KV_CACHE_BYTES = 512 << 20
"""The temporary cache: ten times any L2, so that kernels which tune while profiling read
each layer's keys from memory as they will from the real cache."""
AUTOTUNE_WORKSPACE_BYTES = 256 << 20
"""Triton's benchmarker allocates a 256 MB buffer to flush L2 between timed runs; the
backend tunes after the KV cache is allocated (`AttentionBackend.tune`)."""
GRAPH_SEGMENT_BYTES = 2 << 20
"""The allocator's smallest segment: each captured graph may hold one of its own."""
GRAPH_ROW_BYTES = 128
"""The graph runner's static inputs per batch row besides its block table: four int64 and
two int32 values and four block-table writes of 12 bytes (`cuda_graphs.py`), rounded up."""


class MemoryProbe(Protocol):
    """The device memory readings sizing needs (`CudaMemoryProbe`; tests pass a fake)."""

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None:
        """Return the allocator's unused cached memory to the device."""
        ...

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, whoever uses it."""
        ...

    def memory_reserved(self) -> int:
        """Bytes torch's allocator holds now."""
        ...

    def reset_peak(self) -> None: ...

    def max_memory_reserved(self) -> int:
        """The most bytes torch's allocator held since `reset_peak`."""
        ...


class CudaMemoryProbe:
    """`MemoryProbe` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        gc.collect()  # tensors kept alive only by reference cycles hold their blocks
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


@dataclass(frozen=True)
class ProfileShapes:
    """The limits that make the largest steps."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    graph_batch_size: int | None = None
    """The largest decode batch captured in a CUDA graph; None without graphs."""


@dataclass(frozen=True)
class ProfilePeaks:
    """Bytes each profiled step needed on top of what was in use before it."""

    prefill: int
    decode: int
    graph_forward: int = 0
    """The decode forward alone at the largest graph batch (0 without graphs)."""

    @property
    def activation(self) -> int:
        return max(self.prefill, self.decode)


def prefill_steps(shapes: ProfileShapes) -> list[list[int]]:
    """Query lengths of the largest prefill steps: the token budget over as many sequences
    as one step holds (vLLM's dummy run: the most logits rows), and in one chunk (the
    longest query a backend attends for one sequence)."""
    tokens = min(shapes.max_num_batched_tokens, shapes.max_num_seqs * shapes.max_model_len)
    num_seqs = min(shapes.max_num_seqs, tokens)
    base, extra = divmod(tokens, num_seqs)
    spread = [base + 1] * extra + [base] * (num_seqs - extra)
    chunk = [min(tokens, shapes.max_model_len)]
    return [spread] if spread == chunk else [spread, chunk]


@torch.inference_mode()
def run_dummy_step(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    query_lens: list[int],
    *,
    max_model_len: int,
    block_size: int,
    post_forward: PostForward | None,
) -> None:
    """One step on dummy tokens: sequence i runs `query_lens[i]` queries at the end of a
    `max_model_len` context, its block table cycling over the cache's blocks; then the
    sampling rows' logits go to `post_forward`."""
    device = kv_caches[0].device
    num_blocks = kv_caches[0].shape[1]
    width = -(-max_model_len // block_size)
    num_seqs = len(query_lens)
    context_lens = [max_model_len - q for q in query_lens]
    tables = (np.arange(num_seqs * width).reshape(num_seqs, width) % num_blocks).tolist()
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device)
    positions = np.concatenate(
        [np.arange(c, c + q) for c, q in zip(context_lens, query_lens, strict=True)]
    )
    input_ids = np.arange(len(positions)) % model.config.vocab_size
    model.attn_backend.plan(meta, kv_caches[0])
    hidden = model(
        torch.from_numpy(input_ids).to(device),
        torch.from_numpy(positions).to(device),
        meta,
        kv_caches,
    )
    if post_forward is not None:
        last_rows = meta.query_start_loc[1:].long() - 1
        post_forward(model.compute_logits(hidden.index_select(0, last_rows)), hidden)


def profile_steps(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    shapes: ProfileShapes,
    post_forward: PostForward,
    probe: MemoryProbe,
) -> ProfilePeaks:
    """Run the largest steps one by one; each one's peak on top of what was in use."""

    def peak(query_lens: list[int], post: PostForward | None) -> int:
        probe.synchronize()
        probe.empty_cache()
        probe.reset_peak()
        before = probe.memory_reserved()
        run_dummy_step(
            model,
            kv_caches,
            query_lens,
            max_model_len=shapes.max_model_len,
            block_size=shapes.block_size,
            post_forward=post,
        )
        probe.synchronize()
        return max(0, probe.max_memory_reserved() - before)

    prefill = max(peak(lens, post_forward) for lens in prefill_steps(shapes))
    decode = peak([1] * shapes.max_num_seqs, post_forward)
    graph = shapes.graph_batch_size
    graph_forward = 0 if graph is None else peak([1] * graph, None)
    return ProfilePeaks(prefill, decode, graph_forward)


def graph_pool_estimate(
    forward_peak: int, shapes: ProfileShapes, hidden_size: int, dtype: torch.dtype
) -> int:
    """Memory the decode graphs will hold: the largest bucket's forward (captured first;
    the smaller graphs reuse its pool), the output every other graph keeps, a segment of
    rounding per graph, and the graph runner's static inputs (`cuda_graphs.py`)."""
    if shapes.graph_batch_size is None:
        return 0
    buckets = batch_size_buckets(shapes.graph_batch_size)
    element = torch.empty((), dtype=dtype).element_size()
    outputs = sum(buckets[:-1]) * hidden_size * element
    n, width = buckets[-1], -(-shapes.max_model_len // shapes.block_size)
    # The int32 block tables, and under GRAPH_ROW_BYTES a row of staged inputs (ids,
    # positions, slots, rows, lengths, block-table writes).
    static = n * width * 4 + n * GRAPH_ROW_BYTES
    return forward_peak + outputs + len(buckets) * GRAPH_SEGMENT_BYTES + static


def block_table_bytes(shapes: ProfileShapes) -> int:
    """The most the runner's persistent block table (`runner/block_table.py`) reaches: it
    doubles rows and columns as it grows, so up to twice `max_num_seqs` + 1 rows (row 0 is
    padding) of twice the widest table, int32."""
    width = -(-shapes.max_model_len // shapes.block_size)
    return 2 * (shapes.max_num_seqs + 1) * 2 * width * 4


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, tied ones counted once."""
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def profile_memory(
    model: CausalLM,
    model_config: ModelConfig,
    shapes: ProfileShapes,
    post_forward: PostForward,
    probe: MemoryProbe,
    *,
    dtype: torch.dtype,
    device: torch.device,
    autotunes: bool,
    kv_cache_dtype: torch.dtype | None = None,
) -> MemoryUse:
    """What the device holds once the model is loaded, and what the largest steps, the
    autotuner (`autotunes`: the backend tunes after the cache exists) and the decode graphs
    will need on top: the input of `kv_budget.plan_kv_cache`."""
    started = time.perf_counter()
    mc = model_config
    probe.empty_cache()
    free, _ = probe.mem_get_info()
    # The profile's forwards read a cache of the real one's dtype (--kv-cache-dtype): a
    # cache narrower than the model's dtype is read through casts, which take memory too.
    kv_dtype = kv_cache_dtype or dtype
    per_block = kv_cache_bytes_per_block(
        1, shapes.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype
    )
    num_blocks = max(1, min(PROFILE_KV_CACHE_BYTES, free // 4) // per_block)
    [cache] = allocate_kv_caches(
        1, num_blocks, shapes.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype, device
    )
    kv_caches = [cache] * mc.num_layers
    peaks = profile_steps(model, kv_caches, shapes, post_forward, probe)
    del cache, kv_caches
    probe.synchronize()
    probe.empty_cache()
    free, total = probe.mem_get_info()
    logger.info(
        "profiled the largest steps in %.1fs: prefill %.2f GiB, decode %.2f GiB, "
        "graph forward %.2f GiB",
        time.perf_counter() - started,
        *(x / (1 << 30) for x in (peaks.prefill, peaks.decode, peaks.graph_forward)),
    )
    return MemoryUse(
        total=total,
        free=free,
        torch_reserved=probe.memory_reserved(),
        weights=weight_bytes(model),
        activation_peak=peaks.activation,
        autotune_workspace=AUTOTUNE_WORKSPACE_BYTES if autotunes else 0,
        graph_pool=graph_pool_estimate(peaks.graph_forward, shapes, mc.hidden_size, dtype),
        runner_buffers=block_table_bytes(shapes),
    )
