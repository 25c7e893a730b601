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

A step's inputs cross in one copy: every per-row input (token ids, positions, slots,
lengths, block-table rows) and the step's block-table writes are views of one byte buffer
on the device, filled on the host in a twin buffer (pinned on CUDA) and moved by one
non-blocking copy; then the writes are applied to the runner's persistent block table and
its rows gathered into the static table (`gpu_worker.runner.block_table`): at most three
launches before the replay, where per-tensor copies and padding fills took eleven.

With LoRA on (`set_lora_rows`, the model's `LoRAState.set_rows`), each row's adapter slot is
one more staged input (-1 in padding rows, which then add nothing) and the forward plans
the adapters over that static buffer, so a graph captures the LoRA kernels reading it
(their decode shape reads the slots on the device and never syncs) and replays whatever
adapters the step's rows name; the slots' weight stacks are static too.

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

import numpy as np
import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata, BatchLayout
from gpu_worker.models.base import CausalLM
from gpu_worker.runner.block_table import BlockTable, BlockTableStep

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]

WARMUP_CONTEXT_TOKENS = 4096
"""Context length of the warm-up rows run before capture (should a key have escaped the
backend's start-up `tune()`, it is tuned on realistic work, never inside a capture)."""


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch_size` (itself included): at most
    7 rows of padding above 8, and few enough graphs to capture in seconds."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    buckets += list(range(8, max_batch_size, 8))
    buckets.append(max_batch_size)
    return sorted(set(buckets))


class StagedInputs:
    """Named arrays in one byte buffer on the device, with a twin on the host (pinned on
    CUDA): a step writes the host views, then `copy` moves them all at once; the device
    views keep their addresses for good, so captured graphs can read them."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, int]], device: torch.device) -> None:
        offsets: dict[str, tuple[int, int]] = {}
        size = 0
        for name, (dtype, count) in fields.items():
            nbytes = count * dtype.itemsize
            offsets[name] = (size, nbytes)
            size += -(-nbytes // 8) * 8  # every view starts 8-byte aligned
        on_cuda = device.type == "cuda"
        self.host_buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=on_cuda)
        self.device_buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, (start, nbytes) in offsets.items():
            dtype = fields[name][0]
            self.host[name] = self.host_buffer[start : start + nbytes].view(dtype).numpy()
            self.device[name] = self.device_buffer[start : start + nbytes].view(dtype)
        self._copied = torch.cuda.Event() if on_cuda else None

    def wait(self) -> None:
        """Block until the last copy has read the host buffer, before writing it again."""
        if self._copied is not None:
            self._copied.synchronize()

    def copy(self) -> None:
        """Move the whole host buffer to the device views (non-blocking on CUDA)."""
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


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
        block_table: BlockTable,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: bool,
        set_lora_rows: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use capture=False elsewhere")
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_table = block_table
        block_table.reserve(max_blocks_per_seq)
        self.device = device
        self.capture = capture
        self.block_size = block_size
        self.buckets = batch_size_buckets(max_batch_size)
        self.max_batch_size = n = self.buckets[-1]
        self.max_table_writes = 4 * n
        """Block-table writes a graph step carries; a step with more (a long table given
        its row in a one-token chunk, which is rare) runs eagerly."""
        i64, i32 = torch.int64, torch.int32
        fields = {
            "input_ids": (i64, n),
            "positions": (i64, n),
            "slot_mapping": (i64, n),
            "rows": (i64, n),
            "write_index": (i64, self.max_table_writes),
            "seq_lens": (i32, n),
            "context_lens": (i32, n),
            "write_values": (i32, self.max_table_writes),
        }
        self.set_lora_rows = set_lora_rows
        if set_lora_rows is not None:
            fields["lora_slots"] = (i32, n)
        self.staged = StagedInputs(fields, device)
        static = self.staged.device
        self.input_ids = static["input_ids"]
        self.positions = static["positions"]
        self.slot_mapping = static["slot_mapping"]
        self.seq_lens = static["seq_lens"]
        self.context_lens = static["context_lens"]
        # Rows past every step write nothing, in the buffers the capture reads and in the
        # host twin each step's copy brings over.
        self.slot_mapping.fill_(-1)
        self.staged.host["slot_mapping"].fill(-1)
        self.lora_slots: torch.Tensor | None = static.get("lora_slots")
        """Each row's adapter slot (-1: none), when LoRA is on."""
        if self.lora_slots is not None:
            self.lora_slots.fill_(-1)
            self.staged.host["lora_slots"].fill(-1)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=i32, device=device)
        # One query per sequence, always: query_start_loc is 0..n and never changes.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Graph] = {}

    def can_run(self, layout: BatchLayout, table: BlockTableStep) -> bool:
        """Whether this step can replay a graph: pure decode, few enough sequences, block
        tables no wider than the static buffer and few enough table writes."""
        return (
            layout.max_query_len == 1
            and self.bucket_for(layout.num_seqs) is not None
            and table.width <= self.block_tables.shape[1]
            and table.num_writes <= self.max_table_writes
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

        Each bucket runs eagerly twice first: the Triton launchers compile then (their configs
        were chosen by the backend's start-up `tune()`; a capture must not benchmark), and
        lazy allocations settle.
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
        input_ids: np.ndarray,
        layout: BatchLayout,
        table: BlockTableStep,
        lora_slots: np.ndarray | None = None,
        fill_inputs: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """One decode step of `layout.num_seqs` sequences -> hidden states [num_seqs, hidden].

        `fill_inputs` writes the input ids the host does not have yet (async scheduling)
        into the static input buffer, after the staged copy and before the replay.

        The caller checks `can_run` first; inputs are the step's host arrays from the model
        runner (`table` from its `block_table`, `lora_slots` each row's adapter slot with
        LoRA on, None for a base-only step): written into the staged buffer with the
        padding rows, moved in one copy, then the table's writes and rows applied.
        """
        if not self.can_run(layout, table):
            raise ValueError(f"no decode graph fits this step ({layout.num_seqs} sequences)")
        num_seqs = layout.num_seqs
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None
        staged = self.staged
        staged.wait()
        host = staged.host
        # Rows past num_seqs are padding: they must not write or read the cache, whatever
        # a previous, larger step left there.
        for name, values, pad in (
            ("input_ids", input_ids, 0),
            ("positions", layout.positions, 0),
            ("slot_mapping", layout.slot_mapping, -1),
            ("seq_lens", layout.seq_lens, 0),
            ("context_lens", layout.context_lens, 0),
            ("rows", table.rows, 0),  # row 0 is the block table's null row
        ):
            host[name][:num_seqs] = values
            host[name][num_seqs:bucket] = pad
        if self.lora_slots is not None:
            host["lora_slots"][:num_seqs] = -1 if lora_slots is None else lora_slots
            host["lora_slots"][num_seqs:bucket] = -1
        elif lora_slots is not None:
            raise ValueError("this graph runner was built without LoRA")
        num_writes = table.num_writes
        host["write_index"][:num_writes] = table.index
        host["write_values"][:num_writes] = table.values
        staged.copy()
        device = staged.device
        if fill_inputs is not None:
            fill_inputs(self.input_ids[:num_seqs])
        self.block_table.apply(
            device["write_index"][:num_writes], device["write_values"][:num_writes]
        )
        width = self.block_tables.shape[1]
        self.block_table.gather(device["rows"][:bucket], width, out=self.block_tables[:bucket])
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
        lora_slots = None if self.lora_slots is None else self.lora_slots[:bucket]

        @torch.inference_mode()
        def forward() -> torch.Tensor:
            # Host work only (none for Triton's kernels), so a captured graph holds nothing
            # of it; eager runs (`capture=False`) plan every step, like the model runner.
            self.attn_backend.plan(meta, self.kv_caches[0])
            if self.set_lora_rows is not None and lora_slots is not None:
                self.set_lora_rows(lora_slots)
            return self.model(input_ids, positions, meta, self.kv_caches)

        return forward
