"""The torch backend's per-step plan: which rows attend how, worked out once per step.

`TorchAttentionBackend.plan` builds it from the metadata before the first layer; every
layer of the step then reuses its index tensors and masks. A sliding window changes the
masks, so layers with a window share a plan of their own, built for that window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.metadata import AttentionMetadata


@dataclass
class PrefillSeq:
    """One sequence with several query tokens this step (a prompt or a prefill chunk)."""

    start: int
    end: int
    """Its tokens are rows `start:end` of the flattened batch."""
    block_ids: torch.Tensor | None
    """[num_blocks] int64 blocks holding its keys; None for a fresh prefill (no cached
    context), which attends to this step's own k/v and needs no gather."""
    mask: torch.Tensor | None
    """[query_len, seq_len] additive (0 / -inf): query j, at position context_len + j,
    sees keys up to there (and within the window). None for a fresh prefill without a
    window, which is plain causal."""


@dataclass
class DecodeGroup:
    """Single-query sequences attended in one SDPA call."""

    rows: slice | torch.Tensor
    """Their rows in the batch: a slice when contiguous, else an int64 index."""
    block_ids: torch.Tensor
    """[num_seqs * num_blocks] int64: each one's block table cut to the group's longest."""
    mask: torch.Tensor
    """[num_seqs, 1, 1, num_blocks * block_size] additive (0 / -inf): keys past each
    sequence's length, or before its window, are hidden."""


@dataclass
class KernelDecodes:
    """A mixed step's single-query sequences, for the CPU paged decode kernel (which reads
    K/V straight from the blocks: no gather, no mask)."""

    rows: slice | torch.Tensor
    """Their rows in the batch: a slice when contiguous, else an int64 index."""
    block_tables: torch.Tensor
    """[num_decodes, max_blocks] int32, contiguous: their rows of the block table."""
    seq_lens: torch.Tensor
    """[num_decodes] int32, contiguous."""


@dataclass
class TorchAttentionPlan:
    """What every layer of one step does, worked out once from the metadata.

    Sequences with one query token (decodes) are sorted by length and cut into groups,
    one SDPA call each; longer ones (prefill chunks) run one call each. Index tensors and
    masks are shared by all layers. When the CPU kernel takes the decodes
    (`kernel_decodes`), no groups are built.

    Why groups: a decode's keys are scattered over cache blocks, so they are gathered
    into one padded tensor first. Gathering the whole batch at once (17 MB a layer at 32
    sequences of 370 tokens) writes it out to memory and reads it back for SDPA; a group
    of ~4 MB stays in the CPU's cache between the two. That cut the attention time by a
    quarter there (5-8% of the step); results are the same bit for bit, since every row
    is computed alone. Sorting keeps each group's padding short.
    """

    decode: list[DecodeGroup]
    prefills: list[PrefillSeq]
    kernel_decodes: KernelDecodes | None = None

    @classmethod
    def build(
        cls,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        dtype: torch.dtype,
        decode_kernel: bool = False,
        window: int | None = None,
    ) -> TorchAttentionPlan:
        """Plan the step for one layer's `kv_cache` (all layers share its shape) and
        queries of `dtype`; `decode_kernel` hands the decodes to `cpu_ops` (which has no
        window). With a sliding `window` the query at p sees keys p - window < k <= p."""
        # Host copies when the builder passed them: no device read-back on CUDA.
        starts = meta.query_start_loc_host
        if starts is None:
            starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens_host
        if context_lens is None:
            context_lens = meta.context_lens.tolist()
        block_size = kv_cache.shape[2]
        device = meta.block_tables.device
        decodes: list[int] = []
        prefills: list[PrefillSeq] = []
        for i, ctx in enumerate(context_lens):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                decodes.append(i)
            elif end - start > 1:
                prefills.append(cls._prefill(meta, i, start, end, ctx, block_size, dtype, window))

        if decode_kernel:
            kernel = None
            if decodes:
                index = torch.tensor(decodes, dtype=torch.int64, device=device)
                kernel = KernelDecodes(
                    _as_index([starts[i] for i in decodes], device),
                    meta.block_tables.index_select(0, index).contiguous(),
                    meta.seq_lens.index_select(0, index).contiguous(),
                )
            return cls([], prefills, kernel)

        # Gathered bytes per key position (K and V); GPUs have no such cache to fit.
        token_bytes = 2 * kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        budget = _DECODE_GROUP_BYTES if kv_cache.device.type == "cpu" else None
        decodes.sort(key=lambda i: context_lens[i])
        groups: list[list[int]] = []
        for i in decodes:  # ascending length: the newest member is the group's longest
            keys = context_lens[i] + 1
            if window is not None:
                keys = min(keys, window + block_size)  # gathered from the window's block on
            if groups and (budget is None or (len(groups[-1]) + 1) * keys * token_bytes <= budget):
                groups[-1].append(i)
            else:
                groups.append([i])
        plan = [
            cls._decode_group(meta, group, starts, context_lens, block_size, dtype, window)
            for group in groups
        ]
        return cls(plan, prefills)

    @staticmethod
    def _prefill(
        meta: AttentionMetadata,
        seq: int,
        start: int,
        end: int,
        ctx: int,
        block_size: int,
        dtype: torch.dtype,
        window: int | None,
    ) -> PrefillSeq:
        if ctx == 0 and window is None:
            return PrefillSeq(start, end, None, None)
        device = meta.block_tables.device
        seq_len = ctx + end - start
        blocks = None
        if ctx > 0:
            blocks = meta.block_tables[seq, : -(-seq_len // block_size)].long()
        q_pos = torch.arange(ctx, seq_len, device=device)[:, None]
        key_pos = torch.arange(seq_len, device=device)[None, :]
        hidden = key_pos > q_pos
        if window is not None:
            hidden |= key_pos <= q_pos - window
        return PrefillSeq(start, end, blocks, _additive_mask(hidden, dtype))

    @staticmethod
    def _decode_group(
        meta: AttentionMetadata,
        seqs: list[int],
        starts: list[int],
        context_lens: list[int],
        block_size: int,
        dtype: torch.dtype,
        window: int | None,
    ) -> DecodeGroup:
        device = meta.block_tables.device
        index = _as_index(seqs, device)
        seq_lens = meta.seq_lens[index][:, None]
        if window is None:
            num_blocks = -(-(context_lens[seqs[-1]] + 1) // block_size)
            # Padding entries (0 or -1) read some block's keys; the mask hides them.
            tables = meta.block_tables[index, :num_blocks].clamp(min=0).long()
            hidden = torch.arange(num_blocks * block_size, device=device)[None, :] >= seq_lens
        else:
            # Each sequence's blocks from the one holding its window's first key: a long
            # context costs a window's worth of gather, not the whole context.
            first = [max(context_lens[i] + 1 - window, 0) // block_size for i in seqs]
            ends = [-(-(context_lens[i] + 1) // block_size) for i in seqs]
            num_blocks = max(end - f for f, end in zip(first, ends, strict=True))
            first_t = torch.tensor(first, device=device)[:, None]
            cols = first_t + torch.arange(num_blocks, device=device)
            cols = cols.clamp(max=meta.block_tables.shape[1] - 1)  # past the end: masked
            tables = meta.block_tables[index].gather(1, cols).clamp(min=0).long()
            key_pos = first_t * block_size + torch.arange(num_blocks * block_size, device=device)
            hidden = (key_pos >= seq_lens) | (key_pos < seq_lens - window)
        mask = _additive_mask(hidden, dtype)[:, None, None, :]
        rows = _as_index([starts[i] for i in seqs], device)
        return DecodeGroup(rows, tables.reshape(-1), mask)


_DECODE_GROUP_BYTES = 4 << 20
"""Gathered keys and values per decode group on CPU: about one core's L2."""


def _additive_mask(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "cannot see" -> 0 / -inf in the query dtype. SDPA would convert a boolean
    mask like this in every layer; done once, the layers share it."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf")
    )


def _as_index(values: list[int], device: torch.device) -> slice | torch.Tensor:
    """A run of consecutive ints as a slice (a view when indexing), else an int64 index."""
    if values[-1] - values[0] == len(values) - 1:
        return slice(values[0], values[-1] + 1)
    return torch.tensor(values, dtype=torch.int64, device=device)
