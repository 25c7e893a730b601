"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket.

A decode step of a small model on a fast GPU is bound by launching kernels (a few hundred
per step), not by running them. A graph replays the whole forward in one launch; the price
is that every tensor it touches must live at a fixed address and have a fixed shape. So the
runner owns static input buffers sized for the largest bucket, a step with `n` sequences
runs the graph of the smallest bucket `>= n`, and the rows past `n` are padding:

- slot -1: the KV write skips them (kernels/cache_ops.py), so no sequence's cache changes;
- seq_len 0: decode attention gives them zeros without reading a block (an empty partition);
- token id 0 at position 0: any valid index, their hidden states are never read.

Block tables are as wide as `max_model_len` allows, so a graph serves any context; the decode
kernel's split-K grid depends only on that width and the bucket, never on the lengths.

Only pure-decode steps on the Triton backend replay graphs; prefill chunks and mixed steps
run eagerly (their token counts vary too much to bucket). With `capture=False` the runner
runs the same static-buffer path without capturing: the CPU tests drive the padding logic
through it, and on a GPU it isolates a graph problem from a padding one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.models.base import CausalLM

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]

WARMUP_CONTEXT_TOKENS = 4096
"""Context length of the warm-up rows the decode kernel autotunes on before capture."""


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch_size` (itself included): at most
    7 rows of padding above 8, and few enough graphs to capture in seconds."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    buckets += list(range(8, max_batch_size, 8))
    buckets.append(max_batch_size)
    return sorted(set(buckets))


@dataclass
class _Graph:
    """One captured bucket: replaying refreshes `output` in place."""

    replay: Callable[[], None]
    output: torch.Tensor


class DecodeGraphRunner:
    """Static buffers plus one captured forward per bucket; `run` pads, replays, slices."""

    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use capture=False elsewhere")
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.device = device
        self.capture = capture
        self.block_size = block_size
        self.buckets = batch_size_buckets(max_batch_size)
        self.max_batch_size = self.buckets[-1]
        n = self.max_batch_size

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(n, dtype=torch.int64)
        self.positions = zeros(n, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = zeros(n, dtype=torch.int32)
        self.context_lens = zeros(n, dtype=torch.int32)
        self.block_tables = zeros(n, max_blocks_per_seq, dtype=torch.int32)
        # One query per sequence, always: query_start_loc is 0..n and never changes.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Graph] = {}

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether this step can replay a graph: pure decode, few enough sequences, and
        block tables no wider than the static buffer."""
        return (
            meta.is_pure_decode
            and self.bucket_for(meta.num_seqs) is not None
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs`, or None when the step is too big."""
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool
        (nothing to do without `capture`: `run` then calls the forward directly).

        Each bucket runs eagerly twice first: the Triton launchers compile and autotune then
        (autotuning benchmarks, which a capture must not), and lazy allocations settle.
        """
        if not self.capture:
            return
        started = time.perf_counter()
        self._fill_warmup_contexts()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            forward = self._forward_for(bucket)
            for _ in range(2):
                forward()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = forward()
            torch.cuda.synchronize(self.device)
            self._graphs[bucket] = _Graph(replay=graph.replay, output=output)
        self.seq_lens.zero_()
        self.block_tables.zero_()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1fs",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            time.perf_counter() - started,
        )

    def _fill_warmup_contexts(self) -> None:
        """Give the warm-up rows real contexts (spread over the cache, nothing written: every
        slot stays -1), so that the decode kernel autotunes on work like a real step's rather
        than on empty sequences; its choice is cached per shape and replayed by the graph."""
        num_blocks = self.kv_caches[0].shape[1]
        rows, width = self.block_tables.shape
        ids = torch.arange(rows * width, device=self.device, dtype=torch.int64) % num_blocks
        self.block_tables.copy_(ids.view(rows, width))
        self.seq_lens.fill_(min(width * self.block_size, WARMUP_CONTEXT_TOKENS))

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One decode step of `meta.num_seqs` sequences -> hidden states [num_seqs, hidden].

        The caller checks `can_run` first; inputs are this step's device tensors from the
        model runner, copied into the static buffers (a handful of device-to-device copies).
        """
        if not self.can_run(meta):
            raise ValueError(f"no decode graph fits this step ({meta.num_seqs} sequences)")
        num_seqs = meta.num_seqs
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None
        width = meta.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.context_lens[:num_seqs].copy_(meta.context_lens)
        # Columns past `width` keep stale ids: attention never reads past seq_len.
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if num_seqs < bucket:
            # Rows a previous, larger step left behind must not write or read the cache.
            self.input_ids[num_seqs:bucket].zero_()
            self.positions[num_seqs:bucket].zero_()
            self.slot_mapping[num_seqs:bucket].fill_(-1)
            self.seq_lens[num_seqs:bucket].zero_()
            self.context_lens[num_seqs:bucket].zero_()
        if not self.capture:
            return self._forward_for(bucket)()[:num_seqs]
        graph = self._graphs.get(bucket)
        if graph is None:
            raise RuntimeError("capture_all() was not called")
        graph.replay()
        return graph.output[:num_seqs]

    def _forward_for(self, bucket: int) -> Forward:
        """The forward over the first `bucket` rows of the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            context_lens=self.context_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
        )
        input_ids = self.input_ids[:bucket]
        positions = self.positions[:bucket]

        @torch.inference_mode()
        def forward() -> torch.Tensor:
            # Host work only (none for Triton's kernels), so a captured graph holds nothing
            # of it; eager runs (`capture=False`) plan every step, like the model runner.
            self.attn_backend.plan(meta, self.kv_caches[0])
            return self.model(input_ids, positions, meta, self.kv_caches)

        return forward
