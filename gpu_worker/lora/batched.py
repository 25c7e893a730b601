"""Many adapters in one batch: each token row adds its own adapter's low-rank update.

Layout (shared with `kernels.lora`): `a_stack [slots, r_max, in]`, `b_stack [slots, out,
r_max]`, zero-padded past each adapter's rank, fp32 `scales [slots]` (lora_alpha / r, or
/ sqrt(r) with rsLoRA), and an int32/int64 slot per row, -1 for rows without an adapter.

On CUDA with Triton installed, `add_lora` runs the punica-style kernels; elsewhere torch:
rows gathered and sorted once by slot, then one matmul pair per slot present, rounding as
PEFT does (`lora_A(x)` and `lora_B(...)` in the model dtype, then scaled and added).
bench/lora.py chose grouping over gathering each row's A and B for two batched matmuls: the
gather copies `rows * r_max * (in + out)` weights per call: 2.6-12x slower than grouping
from 32 rows up, and at 1-8 rows at best 0.84x of it (8 adapters, 8 rows), not worth a
second path (bench/RESULTS.md, section lora). A batch on one adapter skips the gather and scatter.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """`y[i] += scales[s] * (x[i] @ a_stack[s].T) @ b_stack[s].T` for each row i whose slot
    `s = row_slots[i]` is not -1, in place. y `[rows, out]` may be a column view of a fused
    projection's output (the q part of qkv, say): its rows need not be contiguous."""
    if x.shape[0] == 0:
        return
    if x.is_cuda and _have_triton():
        from kernels.lora import lora_add

        lora_add(y, x, a_stack, b_stack, scales, row_slots)
    else:
        add_lora_grouped(y, x, a_stack, b_stack, scales, row_slots)


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def add_lora_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """The torch path: one sort, then per slot with rows a matmul pair over those rows."""
    num_slots = a_stack.shape[0]
    slots = row_slots.to(torch.int64)
    # Base rows (-1) count as group 0, so they sort first and are skipped in one step.
    counts = torch.bincount(slots + 1, minlength=num_slots + 1).tolist()
    if counts[0] == x.shape[0]:
        return
    order = slots.argsort(stable=True)
    slot_scales = scales.tolist()
    start = counts[0]
    for slot in range(num_slots):
        count = counts[slot + 1]
        if not count:
            continue
        if count == x.shape[0]:  # one adapter for the whole batch: no gather, no scatter
            y += F.linear(F.linear(x, a_stack[slot]), b_stack[slot]) * slot_scales[slot]
            return
        rows = order[start : start + count]
        start += count
        shrunk = F.linear(x.index_select(0, rows), a_stack[slot])
        delta = F.linear(shrunk, b_stack[slot]) * slot_scales[slot]
        y.index_add_(0, rows, delta)
