"""kernels.lora (BGMV at decode sizes, SGMV above) against its row-by-row torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import BGMV_MAX_ROWS, SGMV_BLOCK_M, lora_add, lora_add_ref, slot_blocks
from tests.kernels.conftest import random_tensor

# The kernel keeps `scale * t @ B.T + y` in fp32 and rounds once; the reference rounds
# t, the product and the sum separately in fp16/bf16.
LORA_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 3e-2),
}
SLOTS, R_MAX, IN, OUT = 3, 16, 40, 24
RANKS = (16, 8, 16)


def _adapters(dtype: torch.dtype, device: torch.device):
    a = random_tensor(SLOTS, R_MAX, IN, dtype=torch.float32, device=device, seed=2) / IN**0.5
    b = random_tensor(SLOTS, OUT, R_MAX, dtype=torch.float32, device=device, seed=3)
    for slot, rank in enumerate(RANKS):  # rank 8 zero-padded into r_max 16
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    scales = torch.tensor([2.0, 0.5, 1.0], device=device)
    return a.to(dtype), (b / R_MAX**0.5).to(dtype), scales


def _row_slots(rows: int, device: torch.device) -> torch.Tensor:
    """Every slot and -1, unsorted, slot 0 with more than one SGMV block of rows."""
    gen = torch.Generator().manual_seed(rows)
    slots = torch.randint(-1, SLOTS, (rows,), generator=gen, dtype=torch.int32)
    slots[: rows // 2] = torch.where(slots[: rows // 2] == 1, 0, slots[: rows // 2])
    head = min(rows, 4)
    slots[:head] = torch.tensor([1, -1, 0, 2], dtype=torch.int32)[:head]
    return slots.to(device)


@pytest.mark.parametrize(
    ("rows", "col_offset"),
    [(1, 0), (9, 0), (9, 5), (BGMV_MAX_ROWS + 11, 0), (BGMV_MAX_ROWS + 11, 5)],
    ids=["bgmv-one-row", "bgmv", "bgmv-fused-part", "sgmv", "sgmv-fused-part"],
)
def test_lora_add_matches_reference(device, dtype, rows, col_offset):
    a, b, scales = _adapters(dtype, device)
    x = random_tensor(rows, IN, dtype=dtype, device=device, seed=4)
    row_slots = _row_slots(rows, device)
    if rows > BGMV_MAX_ROWS:
        assert (row_slots == 0).sum() > SGMV_BLOCK_M  # a slot spanning two blocks
    y = random_tensor(rows, col_offset + OUT + 7, dtype=dtype, device=device, seed=5)
    expected = y.clone().float()
    lora_add_ref(expected, x.float(), a.float(), b.float(), scales, row_slots, col_offset)
    lora_add(y, x, a, b, scales, row_slots, col_offset)
    atol, rtol = LORA_TOL[dtype]
    torch.testing.assert_close(y.float(), expected, atol=atol, rtol=rtol)
    outside = torch.ones(y.shape[1], dtype=torch.bool)
    outside[col_offset : col_offset + OUT] = False
    assert torch.equal(y[:, outside.to(device)].float(), expected[:, outside.to(device)])


def test_lora_add_into_a_column_view(device):
    """The other calling form: y is a view of the fused output, col_offset 0."""
    a, b, scales = _adapters(torch.float32, device)
    rows = 6
    x = random_tensor(rows, IN, dtype=torch.float32, device=device, seed=4)
    row_slots = _row_slots(rows, device)
    fused = random_tensor(rows, 3 + OUT + 2, dtype=torch.float32, device=device, seed=6)
    expected = fused.clone()
    lora_add_ref(expected, x, a, b, scales, row_slots, col_offset=3)
    lora_add(fused[:, 3 : 3 + OUT], x, a, b, scales, row_slots)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


def test_base_rows_and_empty_batches_are_untouched(device):
    a, b, scales = _adapters(torch.float32, device)
    x = random_tensor(BGMV_MAX_ROWS + 3, IN, dtype=torch.float32, device=device, seed=4)
    y = random_tensor(BGMV_MAX_ROWS + 3, OUT, dtype=torch.float32, device=device, seed=5)
    before = y.clone()
    lora_add(y, x, a, b, scales, torch.full((x.shape[0],), -1, dtype=torch.int32, device=device))
    assert torch.equal(y, before)
    empty = torch.empty(0, OUT, device=device)
    no_slots = torch.empty(0, dtype=torch.int32, device=device)
    lora_add(empty, torch.empty(0, IN, device=device), a, b, scales, no_slots)


def test_slot_blocks_give_each_block_one_slot_and_skip_base_rows():
    row_slots = torch.tensor([2, -1, 0, 2, -1, 0, 0], dtype=torch.int32)
    row_ids, block_slots = slot_blocks(row_slots, 3)
    assert row_ids.numel() == block_slots.numel() * SGMV_BLOCK_M
    seen = []
    for block, slot in enumerate(block_slots.tolist()):
        ids = row_ids[block * SGMV_BLOCK_M : (block + 1) * SGMV_BLOCK_M]
        real = ids[ids < row_slots.numel()].tolist()
        if slot < 0:
            assert all(row_slots[i] == -1 for i in real)
        else:
            assert real
            assert all(row_slots[i] == slot for i in real)
            seen += real
    assert sorted(seen) == [0, 2, 3, 5, 6]
