"""What attention needs to know about one step's flattened batch, and the one function that
builds it: the model runner calls it every step, tests and benchmarks call it too.

The batch is flattened: prefill chunks of several sequences and single-token decodes sit
side by side. `AttentionMetadata` says which tokens belong to which sequence and where
their K/V live in the paged cache (layout: `gpu_worker.runner.kv_caches`).

Building is two steps: `layout_batch` is pure numpy on the host (one vectorized pass,
however many prefill tokens), and `upload_batch` moves it to the device as two packed
buffers, one per dtype, from pinned memory on CUDA, instead of one small copy per tensor.
Block tables come separately: the model runner keeps them in persistent rows on the device
(`gpu_worker.runner.block_table`) and gathers the step's; `build_attention_metadata`, for
tests and benchmarks, uploads them from lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each token of a flattened batch belongs, for one model step.

    Tokens are grouped by sequence, in order: sequence `i` owns tokens
    `query_start_loc[i]:query_start_loc[i + 1]`, which sit at absolute positions
    `context_lens[i] .. seq_lens[i] - 1`.
    """

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) for each new token."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: prefix sums of the per-sequence query lengths."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context length including this step's new tokens."""
    context_lens: torch.Tensor
    """[num_seqs] int32: tokens already in the cache before this step (num_computed_tokens)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32: block ids per sequence. Entries past a sequence's
    own blocks are padding, never read: 0, -1, or (from the runner's persistent rows) ids
    a row held before, always real blocks."""
    max_query_len: int
    """Longest query in the batch; 1 means the step is all decodes."""
    max_seq_len: int
    """Longest seq_len in the batch."""
    query_start_loc_host: list[int] | None = None
    """`query_start_loc` as a host list, when the builder has it: the torch backend plans
    its per-sequence work from it without reading the device tensors back."""
    context_lens_host: list[int] | None = None
    """`context_lens` as a host list, likewise."""

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class BatchLayout:
    """One step's batch on the host (int64 numpy arrays), before it crosses to the device."""

    query_start_loc: np.ndarray
    """[num_seqs + 1]: prefix sums of the query lengths."""
    seq_lens: np.ndarray
    """[num_seqs]: context plus this step's tokens."""
    context_lens: np.ndarray
    """[num_seqs]: tokens already in the cache."""
    positions: np.ndarray
    """[num_tokens]: each token's absolute position in its sequence."""
    slot_mapping: np.ndarray
    """[num_tokens]: each token's cache slot."""
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def layout_batch(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    rows: np.ndarray | None = None,
) -> BatchLayout:
    """Lay out a step from per-sequence host values: `query_lens[i]` new tokens of sequence
    `i` after its `context_lens[i]` cached ones (int64 arrays), its KV in the blocks of row
    `rows[i]` of `block_tables` (row `i` without `rows`): a padded `[num_seqs, width]`
    array, or the model runner's persistent table (`gpu_worker.runner.block_table`)."""
    num_seqs = len(query_lens)
    num_tokens = int(query_lens.sum())
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = context_lens + query_lens
    # Token t of sequence i sits at position context_lens[i] + (t - query_start_loc[i]).
    seq_of_token = np.repeat(np.arange(num_seqs) if rows is None else rows, query_lens)
    positions = np.arange(num_tokens) + np.repeat(context_lens - query_start_loc[:-1], query_lens)
    slots = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return BatchLayout(
        query_start_loc,
        seq_lens,
        context_lens,
        positions,
        slots,
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )


def pad_block_tables(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Block-id lists -> one `[num_seqs, longest]` int32 array, padded with 0."""
    width = max((len(t) for t in block_tables), default=0)
    tables = np.zeros((len(block_tables), width), dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    return tables


@dataclass
class UploadedBatch:
    """A layout on the device, and the extra arrays that crossed with it; `metadata` adds
    the block tables, which come from elsewhere (the runner gathers them on the device)."""

    layout: BatchLayout
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    extra: list[torch.Tensor]
    """The `extra` int64 arrays, in their order."""
    extra_i32: list[torch.Tensor]
    """The `extra_i32` int32 arrays, in their order."""

    def metadata(self, block_tables: torch.Tensor) -> AttentionMetadata:
        """The step's attention metadata, with these `[num_seqs, width]` block tables."""
        layout = self.layout
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            context_lens=self.context_lens,
            block_tables=block_tables,
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            query_start_loc_host=layout.query_start_loc.tolist(),
            context_lens_host=layout.context_lens.tolist(),
        )


def upload_batch(
    layout: BatchLayout,
    device: torch.device,
    extra: Sequence[np.ndarray] = (),
    extra_i32: Sequence[np.ndarray] = (),
) -> UploadedBatch:
    """Move the layout and the `extra` arrays (input ids, positions, ...) to `device`: one
    copy per dtype, int64 and int32."""
    slot_mapping, *extra_t = to_device([layout.slot_mapping, *extra], torch.int64, device)
    i32 = [layout.query_start_loc, layout.seq_lens, layout.context_lens, *extra_i32]
    starts, seq_lens, context_lens, *extra_i32_t = to_device(i32, torch.int32, device)
    return UploadedBatch(layout, slot_mapping, starts, seq_lens, context_lens, extra_t, extra_i32_t)


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """The metadata of a step given as host lists, laid out and uploaded by the same
    functions as the model runner's (which keeps its block tables in persistent rows)."""
    tables = pad_block_tables(block_tables)
    layout = layout_batch(
        np.asarray(query_lens, dtype=np.int64),
        np.asarray(context_lens, dtype=np.int64),
        tables,
        block_size,
    )
    uploaded = upload_batch(layout, torch.device(device), extra_i32=[tables.ravel()])
    return uploaded.metadata(uploaded.extra_i32[0].view(tables.shape))


def to_device(
    arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Concatenate host arrays into one buffer, move it to the device in one copy (pinned
    and non-blocking on CUDA) and return views of the parts."""
    sizes = [a.size for a in arrays]
    host = torch.from_numpy(np.concatenate(arrays).astype(_NUMPY[dtype], copy=False))
    if device.type == "cuda":
        packed = host.pin_memory().to(device, non_blocking=True)
    else:
        packed = host.to(device)
    return list(packed.split(sizes))


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}
