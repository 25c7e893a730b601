"""The runner's persistent block table: rows appended to, freed, reused and rewritten.

After every step the device table (fed only the step's flat writes) must equal the host
mirror, and each sequence's row must start with exactly its blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.core.sequence import Sequence
from gpu_worker.runner.block_table import BlockTable, BlockTableStep
from shared.sampling import SamplingParams

CPU = torch.device("cpu")


def _seq(request_id: str, blocks: list[int]) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], SamplingParams(), block_size=16)
    seq.block_table = list(blocks)
    return seq


def _step(table: BlockTable, seqs: list[Sequence]) -> BlockTableStep:
    """`update`, then the device writes, as the runner applies them; checks both copies."""
    step = table.update(seqs)
    table.apply(torch.from_numpy(step.index), torch.from_numpy(step.values))
    assert np.array_equal(table.device_table.numpy(), table.host)
    gathered = table.gather(torch.from_numpy(step.rows), step.width)
    assert gathered.shape == (len(seqs), step.width)
    for row, seq in zip(gathered.tolist(), seqs, strict=True):
        assert row[: len(seq.block_table)] == seq.block_table
    return step


def test_a_decode_step_writes_only_the_blocks_gained() -> None:
    table = BlockTable(CPU)
    a, b = _seq("a", [3]), _seq("b", [4, 5])
    first = _step(table, [a, b])
    assert first.rows.tolist() == [1, 2]  # row 0 is the null row, never handed out
    assert (first.width, first.num_writes) == (2, 3)
    assert _step(table, [b, a]).num_writes == 0  # batch order may change; rows do not
    a.block_table.append(8)
    step = _step(table, [a, b])
    assert step.index.tolist() == [1 * table.num_cols + 1]
    assert step.values.tolist() == [8]
    assert table.host[0].tolist() == [0] * table.num_cols


def test_a_released_row_is_reused_and_overwritten_from_column_zero() -> None:
    table = BlockTable(CPU)
    long, other = _seq("long", [1, 2, 3, 4]), _seq("other", [9])
    _step(table, [long, other])
    table.release(["long", "unknown"])
    assert table.num_live_rows == 1
    short = _seq("short", [7])
    step = _step(table, [other, short])
    assert step.rows.tolist() == [2, 1]  # short took long's row
    assert step.values.tolist() == [7]
    # Past its own block the row keeps long's ids: real blocks, never read (seq_len ends).
    assert table.host[1, :4].tolist() == [7, 2, 3, 4]


def test_a_preempted_sequence_back_with_new_blocks_is_rewritten_in_its_row() -> None:
    table = BlockTable(CPU)
    seq = _seq("a", [1, 2, 3])
    _step(table, [seq])
    # Preempted (blocks freed) and readmitted with other blocks, even as many as before.
    seq.num_preemptions += 1
    seq.block_table = [5, 6, 7]
    step = _step(table, [seq])
    assert step.rows.tolist() == [1]
    assert step.values.tolist() == [5, 6, 7]
    # An id reused by a new request that was never released is rewritten too.
    again = _seq("a", [8])
    assert _step(table, [again]).values.tolist() == [8]


def test_shared_prefix_blocks_sit_in_each_row() -> None:
    table = BlockTable(CPU)
    a, b = _seq("a", [5, 6, 7]), _seq("b", [5, 6, 9])
    step = _step(table, [a, b])
    assert table.gather(torch.from_numpy(step.rows), 3).tolist() == [[5, 6, 7], [5, 6, 9]]
    table.release(["a"])
    b.block_table.append(11)
    assert _step(table, [b]).values.tolist() == [11]


def test_rows_and_columns_grow_and_the_device_copy_follows() -> None:
    table = BlockTable(CPU, num_rows=2, num_cols=2)
    seqs = [_seq(f"s{i}", list(range(i, i + 1 + i % 5))) for i in range(9)]
    _step(table, seqs)
    assert table.host.shape[0] >= 10
    for i, seq in enumerate(seqs):
        seq.block_table += [100 + i] * 7  # past the old width
    step = _step(table, seqs)
    assert step.num_writes == 9 * 7
    assert table.num_cols >= step.width == 12
    table.reserve(40)
    assert table.num_cols == 40
    _step(table, seqs)
