"""Persistent block tables: one row per live sequence, updated with what changed each step.

Rebuilding every sequence's table from its Python list each step costs time in proportion
to the whole context (12.5 ms for 256 sequences of 32k tokens). A sequence's table only
grows while it runs, so each row here is written once and then appended to: a decode step
writes one entry per sequence that crossed into a new block, nothing for the others.

The table lives twice: a numpy mirror on the host (the slot mapping is computed from it)
and a tensor on the model's device, which receives the same writes as a flat
(index, value) scatter that crosses with the step's other metadata. A step's
`[num_seqs, width]` block tables are then one gather of its rows on the device.

A row is freed when its request leaves the running set (`release`, from the scheduler's
`finished_request_ids`). Its entries stay as they were: a new owner overwrites the columns
it uses, and columns past a sequence's own blocks are never read (attention stops at
`seq_len`); they always hold real block ids, so even a speculative load stays in bounds.
Row 0 is never given out and stays zero: CUDA-graph padding rows gather it.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.core.sequence import Sequence


@dataclass
class _Row:
    index: int
    seq: Sequence
    num_preemptions: int
    num_written: int
    """Leading entries of `seq.block_table` already in the row."""


@dataclass(frozen=True)
class BlockTableStep:
    """What one step's sequences need from the table, and what changed in it."""

    rows: np.ndarray
    """[num_seqs] int64: each sequence's row, in batch order."""
    width: int
    """Blocks of the longest table among them: the width of the step's gathered tables."""
    index: np.ndarray
    """[num_writes] int64: flat positions (row * `num_cols` + column) written this step."""
    values: np.ndarray
    """[num_writes] int32: the block ids written there."""

    @property
    def num_writes(self) -> int:
        return int(self.index.shape[0])


class BlockTable:
    """Block tables of the running sequences, one persistent row each, grown on demand."""

    def __init__(self, device: torch.device, num_rows: int = 16, num_cols: int = 16) -> None:
        self.device = device
        self.host = np.zeros((num_rows, num_cols), dtype=np.int32)
        """The host mirror, [rows, cols]: row r holds its sequence's block ids in order."""
        self.device_table = torch.zeros((num_rows, num_cols), dtype=torch.int32, device=device)
        """The same table on the device, current once a step's writes are applied."""
        self._gathered = torch.empty(0, dtype=torch.int32, device=device)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(num_rows - 1, 0, -1))  # pop() hands out the lowest first

    @property
    def num_cols(self) -> int:
        return int(self.host.shape[1])

    @property
    def num_live_rows(self) -> int:
        return len(self._rows)

    def update(self, seqs: Seq[Sequence]) -> BlockTableStep:
        """Give each sequence a row (a new one, or its own rewritten when it was preempted
        since), write the blocks it gained since last time into the host mirror, and return
        the rows and the writes for the device."""
        rows: list[int] = []
        write_rows: list[int] = []
        write_cols: list[int] = []
        write_values: list[int] = []
        width = 0
        for seq in seqs:
            table = seq.block_table
            num_blocks = len(table)
            row = self._rows.get(seq.request_id)
            if (
                row is None
                or row.seq is not seq
                or row.num_preemptions != seq.num_preemptions
                or row.num_written > num_blocks
            ):
                row = self._assign(seq, row)
            start = row.num_written
            if num_blocks > start:
                if num_blocks > self.num_cols:
                    # Doubling keeps regrowths logarithmic in the longest table.
                    self._grow(self.host.shape[0], max(num_blocks, 2 * self.num_cols))
                self.host[row.index, start:num_blocks] = table[start:]
                write_rows += [row.index] * (num_blocks - start)
                write_cols += range(start, num_blocks)
                write_values += table[start:]
                row.num_written = num_blocks
            rows.append(row.index)
            if num_blocks > width:
                width = num_blocks
        index = np.asarray(write_rows, dtype=np.int64) * self.num_cols
        index += np.asarray(write_cols, dtype=np.int64)
        values = np.asarray(write_values, dtype=np.int32)
        return BlockTableStep(np.asarray(rows, dtype=np.int64), width, index, values)

    def apply(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Apply a step's writes (`BlockTableStep.index`/`values`, on the device)."""
        if index.numel():
            self.device_table.view(-1).index_copy_(0, index, values)

    def gather(
        self, rows: torch.Tensor, width: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`[len(rows), width]` int32 block tables of these rows (device int64 indices),
        into `out`, else into a buffer the next such call reuses (one step's tables)."""
        if out is None:
            # Into a buffer kept across steps: a fresh multi-megabyte tensor each step costs
            # more in page faults on CPU than the copy. The previous step is done with it.
            size = rows.shape[0] * width
            if self._gathered.numel() < size:
                self._gathered = torch.empty(2 * size, dtype=torch.int32, device=self.device)
            out = self._gathered[:size].view(rows.shape[0], width)
        return torch.index_select(self.device_table[:, :width], 0, rows, out=out)

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the rows of requests that left the running set; unknown ids are skipped."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free.append(row.index)

    def reserve(self, num_cols: int, num_rows: int = 0) -> None:
        """Make the table at least `num_rows` x `num_cols` (CUDA graphs gather a fixed width;
        a follower rank takes its leader's shape, since the leader's writes index into it);
        rows added here are free."""
        old_rows = int(self.host.shape[0])
        if num_cols > self.num_cols or num_rows > old_rows:
            self._grow(max(num_rows, old_rows), max(num_cols, self.num_cols))
            self._free.extend(range(num_rows - 1, old_rows - 1, -1))

    def _assign(self, seq: Sequence, row: _Row | None) -> _Row:
        """A row for `seq` to write from column 0: its old one when it had one (a preempted
        sequence back with new blocks, or an id reused without a release), else a free one."""
        if row is None:
            if not self._free:
                num_rows = self.host.shape[0]
                self._grow(2 * num_rows, self.num_cols)
                self._free = list(range(2 * num_rows - 1, num_rows - 1, -1))
            row = _Row(self._free.pop(), seq, seq.num_preemptions, 0)
            self._rows[seq.request_id] = row
        else:
            row.seq, row.num_preemptions, row.num_written = seq, seq.num_preemptions, 0
        return row

    def _grow(self, num_rows: int, num_cols: int) -> None:
        old_rows, old_cols = self.host.shape
        host = np.zeros((num_rows, num_cols), dtype=np.int32)
        host[:old_rows, :old_cols] = self.host
        table = torch.zeros((num_rows, num_cols), dtype=torch.int32, device=self.device)
        table[:old_rows, :old_cols] = self.device_table
        self.host, self.device_table = host, table
