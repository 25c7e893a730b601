"""Many adapters in one batch: each token row adds its own adapter's low-rank update.

Layout (shared with `kernels.lora`): `a_stack [slots, r_max, in]`, `b_stack [slots, out,
r_max]`, zero-padded past each adapter's rank, fp32 `scales [slots]` (lora_alpha / r, or
/ sqrt(r) with rsLoRA), and an int32/int64 slot per row, -1 for rows without an adapter.

A step's rows are planned once (`LoRABatch.plan`, from `LoRAState.set_rows`) and the plan
is read by every projection of the step (7 per decoder layer), so no projection sorts,
counts or syncs. On CUDA with Triton installed `add` runs the punica-style kernels (the
SGMV block order, for steps past `BGMV_MAX_ROWS` rows, is part of the plan); elsewhere
torch: the rows sorted by slot and padded to equal groups over the span of slots present,
then two batched matmuls over all groups at once (`[slots, rows, in] @ A.T @ B.T`) and
scattered back. PEFT rounds `lora_A(x)` and `lora_B(...)` to the model dtype, then scales;
here the scale multiplies `lora_A(x)` (r wide, not out), which differs from PEFT by a
rounding (1e-7 relative in fp32). The parts of a fused projection (q, k and v) share one gather of x
and one scatter into the whole output row. That is a few launches per projection whatever
the number of adapters, where a matmul pair per slot took ~5 per adapter (bench/RESULTS.md,
section lora, measures both). Gathering each row's A and B instead copies `rows * r_max *
(in + out)` weights per call: 2.6-12x slower from 32 rows up. A batch on one adapter skips
the gather and scatter.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class _Groups:
    """The torch path's layout: slots `first .. first + num_groups` each own `group_size`
    consecutive positions; position p reads row `gather_rows[p]` (padding reads row 0 and
    is never scattered)."""

    first: int
    num_groups: int
    group_size: int
    gather_rows: torch.Tensor
    """int64 [num_groups * group_size]."""
    real_positions: torch.Tensor | None
    """int64: the positions holding real rows, in order; None when none is padding."""
    target_rows: torch.Tensor
    """int64: the row each real position adds to."""
    scales: torch.Tensor
    """The span's scales as [num_groups, 1, 1] (a view: reloaded slots stay current)."""


@dataclass(frozen=True)
class LoRABatch:
    """One step's rows, planned once for every projection of the step."""

    row_slots: torch.Tensor
    """int32/int64 [rows], -1 for base rows."""
    scales: torch.Tensor
    """fp32 [slots], the slots' own tensor."""
    num_slots: int
    present: frozenset[int]
    """The slots some row uses (empty on CUDA, where it is not read back)."""
    whole_batch_slot: int | None = None
    """Torch path: the one slot every row uses (no gather, no scatter)."""
    whole_batch_scale: float = 0.0
    """That slot's scale."""
    groups: _Groups | None = None
    """Torch path with rows of several slots or base rows."""
    sgmv_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    """Triton path past BGMV_MAX_ROWS rows: `kernels.lora.slot_blocks` of the rows."""

    @classmethod
    def plan(
        cls, row_slots: torch.Tensor, scales: torch.Tensor, *, use_kernels: bool | None = None
    ) -> LoRABatch | None:
        """The plan for `row_slots` (None when no row has an adapter, known on the host
        only). With the kernels (CUDA and Triton, unless `use_kernels` says otherwise) it
        reads nothing back, so it may be built inside a CUDA graph capture."""
        num_slots = scales.shape[0]
        if use_kernels is None:
            use_kernels = row_slots.is_cuda and _have_triton()
        if use_kernels:
            from kernels.lora import BGMV_MAX_ROWS, slot_blocks

            blocks = None
            if row_slots.numel() > BGMV_MAX_ROWS:
                blocks = slot_blocks(row_slots, num_slots)
            return cls(row_slots, scales, num_slots, frozenset(), sgmv_blocks=blocks)
        slots = row_slots.to(torch.int64)
        # Base rows (-1) count as group 0, so they sort first.
        counts = torch.bincount(slots + 1, minlength=num_slots + 1).tolist()
        num_rows = slots.shape[0]
        if counts[0] == num_rows:
            return None
        present = [slot for slot in range(num_slots) if counts[slot + 1]]
        if counts[present[0] + 1] == num_rows:
            slot = present[0]
            return cls(row_slots, scales, num_slots, frozenset(present), slot, float(scales[slot]))
        return cls(
            row_slots,
            scales,
            num_slots,
            frozenset(present),
            groups=_group(slots, counts, present, scales),
        )

    def add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
    ) -> None:
        """`y[i] += scales[s] * (x[i] @ a_stack[s].T) @ b_stack[s].T` for each row i of an
        adapter slot s, in place; y `[rows, out]` may be a column view of a fused output."""
        self.add_parts(y, x, [(slice(0, y.shape[1]), a_stack, b_stack)])

    def add_parts(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        parts: Sequence[tuple[slice, torch.Tensor, torch.Tensor]],
    ) -> None:
        """`add` for the parts of one fused projection that read the same x: each part's
        `(columns, a_stack, b_stack)` in column order. The torch path gathers x once and
        scatters all parts' updates into y in one `index_add_` over their columns (on a
        whole, contiguous output row that is ~6x faster than into a column view)."""
        if x.shape[0] == 0 or not parts:
            return
        if self.whole_batch_slot is not None:
            self._add_one_adapter(y, x, parts, self.whole_batch_slot)
            return
        groups = self.groups
        if groups is None:
            from kernels.lora import lora_add

            for columns, a_stack, b_stack in parts:
                lora_add(
                    y[:, columns],
                    x,
                    a_stack,
                    b_stack,
                    self.scales,
                    self.row_slots,
                    blocks=self.sgmv_blocks,
                )
            return
        grouped_x = x.index_select(0, groups.gather_rows)
        grouped_x = grouped_x.view(groups.num_groups, groups.group_size, x.shape[1])
        span = slice(groups.first, groups.first + groups.num_groups)
        pieces: list[torch.Tensor] = []
        start = cursor = parts[0][0].start
        for columns, a_stack, b_stack in parts:
            if columns.start > cursor:  # a part no adapter of the step adapts: zeros
                gap = (groups.num_groups, groups.group_size, columns.start - cursor)
                pieces.append(grouped_x.new_zeros(gap))
            shrunk = torch.bmm(grouped_x, a_stack[span].transpose(1, 2))
            shrunk.mul_(groups.scales)  # [groups, rows, r]: cheaper than scaling the update
            pieces.append(torch.bmm(shrunk, b_stack[span].transpose(1, 2)))
            cursor = columns.stop
        delta = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
        flat = delta.view(-1, delta.shape[2])
        if groups.real_positions is not None:
            flat = flat.index_select(0, groups.real_positions)
        y[:, start:cursor].index_add_(0, groups.target_rows, flat)

    def _add_one_adapter(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        parts: Sequence[tuple[slice, torch.Tensor, torch.Tensor]],
        slot: int,
    ) -> None:
        """Every row on one adapter: one shrink of x by all parts' A at once (x is read
        once, which matters at prefill sizes), scaled at rank width, then each part's
        expand accumulated straight into its columns of y (`addmm_`, no update tensor)."""
        a_all = [a_stack[slot] for _, a_stack, _ in parts]
        a_cat = a_all[0] if len(a_all) == 1 else torch.cat(a_all)
        shrunk = F.linear(x, a_cat)
        shrunk.mul_(self.whole_batch_scale)
        rank = a_all[0].shape[0]  # every stack's r_max
        for i, (columns, _, b_stack) in enumerate(parts):
            y[:, columns].addmm_(shrunk[:, i * rank : (i + 1) * rank], b_stack[slot].T)


def _group(
    slots: torch.Tensor, counts: list[int], present: list[int], scales: torch.Tensor
) -> _Groups:
    first, last = present[0], present[-1]
    num_groups = last - first + 1
    group_size = max(counts[slot + 1] for slot in present)
    order = slots.argsort(stable=True)[counts[0] :]
    # Each real row's position: its slot's group start plus its rank within the slot.
    positions: list[int] = []
    for slot in range(first, last + 1):
        start = (slot - first) * group_size
        positions.extend(range(start, start + counts[slot + 1]))
    position_of = torch.tensor(positions, dtype=torch.int64, device=slots.device)
    padded = num_groups * group_size
    gather_rows = torch.zeros(padded, dtype=torch.int64, device=slots.device)
    gather_rows[position_of] = order
    real = None if len(positions) == padded else position_of
    span_scales = scales[first : last + 1].view(num_groups, 1, 1)
    return _Groups(first, num_groups, group_size, gather_rows, real, order, span_scales)


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """`y[i] += scales[s] * (x[i] @ a_stack[s].T) @ b_stack[s].T` for each row i whose slot
    `s = row_slots[i]` is not -1, in place: one projection's plan and add (a step plans
    once with `LoRABatch.plan` instead)."""
    if x.shape[0] == 0:
        return
    batch = LoRABatch.plan(row_slots, scales)
    if batch is not None:
        batch.add(y, x, a_stack, b_stack)
