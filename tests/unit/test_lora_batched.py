"""add_lora's torch path against a float64 row-by-row reference of the PEFT formula."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.lora.batched import LoRABatch, add_lora

SLOTS, R_MAX, IN, OUT = 3, 16, 24, 20
RANKS = (16, 8, 4)  # slot 1 and 2 padded with zeros past their rank


def _adapters(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, R_MAX, IN, generator=gen) / IN**0.5
    b = torch.randn(SLOTS, OUT, R_MAX, generator=gen) / R_MAX**0.5
    for slot, rank in enumerate(RANKS):
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    scales = torch.tensor([alpha / r for alpha, r in zip((32, 16, 4), RANKS, strict=True)])
    return a.to(dtype), b.to(dtype), scales


def _reference(y, x, a, b, scales, row_slots) -> torch.Tensor:
    """y + per row `scale * (x @ A.T) @ B.T` in float64, one row at a time, at the rank of
    each adapter (not r_max): padding must not change the result."""
    out = y.double().clone()
    for i, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            rank = RANKS[slot]
            t = x[i].double() @ a[slot, :rank].double().T
            out[i] += float(scales[slot]) * (t @ b[slot, :, :rank].double().T)
    return out


def _inputs(rows: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=gen).to(dtype)
    y = torch.randn(rows, OUT, generator=gen).to(dtype)
    return x, y


@pytest.mark.parametrize(
    "slots",
    [
        [0, -1, 2, 1, 1, -1, 0, 2, 2, -1, 1],
        [2],
        [1, 1, 1, 1],  # one adapter for the whole batch
        [-1, 2, -1],
        [2, 0, 2, -1, 2, 0, 2],  # slot 1 absent inside the span: an empty padded group
    ],
    ids=["mixed", "one-row", "one-adapter", "one-slot-among-base", "gap-in-span"],
)
def test_add_lora_matches_reference(slots: list[int]) -> None:
    a, b, scales = _adapters(torch.float32)
    row_slots = torch.tensor(slots, dtype=torch.int32)
    x, y = _inputs(len(slots), torch.float32)
    expected = _reference(y, x, a, b, scales, row_slots)
    add_lora(y, x, a, b, scales, row_slots)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def test_base_rows_are_left_bit_for_bit() -> None:
    a, b, scales = _adapters(torch.float32)
    row_slots = torch.tensor([-1, 0, -1, 2], dtype=torch.int64)
    x, y = _inputs(4, torch.float32)
    before = y.clone()
    add_lora(y, x, a, b, scales, row_slots)
    assert torch.equal(y[row_slots < 0], before[row_slots < 0])
    assert not torch.equal(y[row_slots >= 0], before[row_slots >= 0])


def test_all_base_and_empty_batches_change_nothing() -> None:
    a, b, scales = _adapters(torch.float32)
    x, y = _inputs(3, torch.float32)
    before = y.clone()
    add_lora(y, x, a, b, scales, torch.full((3,), -1, dtype=torch.int32))
    assert torch.equal(y, before)
    empty_y = torch.empty(0, OUT)
    add_lora(empty_y, torch.empty(0, IN), a, b, scales, torch.empty(0, dtype=torch.int32))
    assert empty_y.shape == (0, OUT)


def test_add_lora_writes_only_its_columns_of_a_fused_output() -> None:
    """The caller passes the q part of a qkv output: the other columns stay as they were."""
    a, b, scales = _adapters(torch.float32)
    row_slots = torch.tensor([1, -1, 0, 2, 0], dtype=torch.int32)
    x, _ = _inputs(5, torch.float32)
    fused = torch.randn(5, 4 + OUT + 6, generator=torch.Generator().manual_seed(7))
    before = fused.clone()
    part = fused[:, 4 : 4 + OUT]
    expected = _reference(part, x, a, b, scales, row_slots)
    add_lora(part, x, a, b, scales, row_slots)
    torch.testing.assert_close(fused[:, 4 : 4 + OUT].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused[:, :4], before[:, :4])
    assert torch.equal(fused[:, 4 + OUT :], before[:, 4 + OUT :])


def test_bf16_stays_within_rounding_of_the_reference() -> None:
    a, b, scales = _adapters(torch.bfloat16)
    row_slots = torch.tensor([0, 1, 2, -1, 2, 0, 1], dtype=torch.int32)
    x, y = _inputs(7, torch.bfloat16)
    expected = _reference(y, x, a, b, scales, row_slots)
    add_lora(y, x, a, b, scales, row_slots)
    torch.testing.assert_close(y.double(), expected, atol=5e-2, rtol=2e-2)


def test_fused_parts_share_one_scatter_and_leave_skipped_columns() -> None:
    """Two parts of one fused output (a skipped part's columns between them, as when no
    adapter of the step adapts k): each gets its own update, the gap keeps its values."""
    a, b, scales = _adapters(torch.float32)
    a2, b2, _ = _adapters(torch.float32, seed=5)
    row_slots = torch.tensor([1, -1, 0, 2, 0, 2], dtype=torch.int32)
    x, _ = _inputs(6, torch.float32)
    gap = 3
    fused = torch.randn(6, 2 * OUT + gap, generator=torch.Generator().manual_seed(8))
    first, second = slice(0, OUT), slice(OUT + gap, 2 * OUT + gap)
    expected_first = _reference(fused[:, first], x, a, b, scales, row_slots)
    expected_second = _reference(fused[:, second], x, a2, b2, scales, row_slots)
    before = fused.clone()
    batch = LoRABatch.plan(row_slots, scales)
    assert batch is not None
    assert batch.groups is not None
    batch.add_parts(fused, x, [(first, a, b), (second, a2, b2)])
    torch.testing.assert_close(fused[:, first].double(), expected_first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[:, second].double(), expected_second, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused[:, OUT : OUT + gap], before[:, OUT : OUT + gap])
