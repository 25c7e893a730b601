"""kernels.lora (BGMV at decode sizes, SGMV above) against its row-by-row torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.lora.adapter import LoRAAdapter
from gpu_worker.lora.layers import attach_lora, lora_targets
from gpu_worker.lora.slots import LoRASlots
from gpu_worker.runner.block_table import BlockTable
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner
from kernels.lora import BGMV_MAX_ROWS, SGMV_BLOCK_M, lora_add, lora_add_ref, slot_blocks
from tests.helpers.kernel_checks import interpreter_only, random_tensor
from tests.kernels.test_cuda_graphs import BLOCK_SIZE, _decode_step, _model_and_caches

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


def _random_adapter(name: str, shapes: dict[tuple[int, str], tuple[int, int]], seed: int):
    gen = torch.Generator().manual_seed(seed)
    rank = 8
    weights = {
        key: (torch.randn(rank, i, generator=gen) / i**0.5, torch.randn(o, rank, generator=gen))
        for key, (i, o) in shapes.items()
    }
    targets = frozenset(target for _, target in weights)
    return LoRAAdapter(name, rank, 0.5, targets, weights)


@interpreter_only
def test_decode_graph_path_reads_the_adapters_from_its_static_buffer(tiny_llama_dir) -> None:
    """The graph runner's static-buffer path with LoRA on, its kernels (BGMV) under the
    interpreter: 3 rows (slots 1, base, 0) in bucket 4, whose padding row is -1, equal an
    eager forward through the torch path; the plan reads the runner's static slots."""
    model, caches = _model_and_caches(tiny_llama_dir, num_blocks=12)
    for cache in caches:
        cache.normal_()
    eager_caches = [c.clone() for c in caches]
    targets = lora_targets(model)
    shapes = {key: target.shape for key, target in targets.items()}
    slots = LoRASlots(2, 8, shapes, torch.device("cpu"), torch.float32)
    state = attach_lora(model, slots)
    slot_of = slots.acquire(["one", "two"], lambda n: _random_adapter(n, shapes, len(n)))
    state.use_kernels = True
    table = BlockTable(torch.device("cpu"), num_rows=4, num_cols=2)
    runner = DecodeGraphRunner(
        model,
        model.attn_backend,
        caches,
        table,
        max_batch_size=8,
        max_blocks_per_seq=4,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
        capture=False,
        set_lora_rows=state.set_rows,
    )
    runner.capture_all()
    tables, context_lens = [[3, 7], [1], [10, 2, 5]], [20, 9, 40]
    layout, step = _decode_step(table, tables, context_lens, "s")
    row_slots = np.array([slot_of["two"], -1, slot_of["one"]], dtype=np.int32)
    ids = np.array([5, 17, 200])
    hidden = runner.run(ids, layout, step, lora_slots=row_slots)
    assert runner.lora_slots is not None
    assert state.row_slots is not None
    assert state.row_slots.data_ptr() == runner.lora_slots.data_ptr()
    assert runner.lora_slots[:4].tolist() == [*row_slots.tolist(), -1]

    def eager(rows: torch.Tensor | None) -> torch.Tensor:
        meta = build_attention_metadata([1, 1, 1], context_lens, tables, BLOCK_SIZE)
        model.attn_backend.plan(meta, eager_caches[0])
        state.set_rows(rows)
        with torch.inference_mode():
            return model(torch.from_numpy(ids), torch.tensor(context_lens), meta, eager_caches)

    state.use_kernels = False
    expected = eager(torch.from_numpy(row_slots))
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    base = eager(None)
    moved = (expected - base).abs().amax(dim=-1)
    assert moved[1] == 0
    assert bool((moved[[0, 2]] > 1e-3).all())
