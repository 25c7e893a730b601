"""Attention backends over a paged KV cache.

The model is written once against `AttentionBackend`; the batch it sees is flattened (prefill
chunks of several sequences and single-token decodes side by side), and `AttentionMetadata`
says which tokens belong to which sequence and where their K/V live in the cache.

KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Cache slot `s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_worker.ops import cpu_ops


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
    """[num_seqs, max_blocks] int32: block ids per sequence, padded with 0 or -1."""
    max_query_len: int
    """Longest query in the batch; 1 means the step is all decodes."""
    max_seq_len: int
    """Longest seq_len in the batch."""
    query_start_loc_host: list[int] | None = None
    """`query_start_loc` as a host list, when the builder has it: the torch backend plans
    its per-sequence work from it without reading the device tensors back."""
    context_lens_host: list[int] | None = None
    """`context_lens` as a host list, likewise."""
    torch_plan: TorchAttentionPlan | None = field(default=None, repr=False)
    """The torch backend's per-step plan, made by the first layer and reused by the rest."""

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from per-sequence host lists (the model runner's inputs)."""
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            for pos in range(ctx, ctx + q_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]

        def i32(values: Sequence[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=i32(starts),
            seq_lens=i32(seq_lens),
            context_lens=i32(list(context_lens)),
            block_tables=i32(padded).reshape(len(padded), width),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_host=starts,
            context_lens_host=list(context_lens),
        )


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class AttentionBackend(Protocol):
    """What the model calls for attention; a Triton backend implements the same two methods."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new k/v `[num_tokens, num_kv_heads, head_dim]` into their cache slots."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend: q `[num_tokens, num_heads, head_dim]` ->
        out of the same shape, each query seeing its sequence's keys up to its own position."""
        ...


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
    sees keys up to there. None when `block_ids` is."""


@dataclass
class DecodeGroup:
    """Single-query sequences attended in one SDPA call."""

    rows: slice | torch.Tensor
    """Their rows in the batch: a slice when contiguous, else an int64 index."""
    block_ids: torch.Tensor
    """[num_seqs * num_blocks] int64: each one's block table cut to the group's longest."""
    mask: torch.Tensor
    """[num_seqs, 1, 1, num_blocks * block_size] additive (0 / -inf): keys past each
    sequence's length are hidden."""


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
    ) -> TorchAttentionPlan:
        """Plan the step for one layer's `kv_cache` (all layers share its shape) and
        queries of `dtype`; `decode_kernel` hands the decodes to `cpu_ops`."""
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
            elif end - start > 1 and ctx == 0:
                prefills.append(PrefillSeq(start, end, None, None))
            elif end - start > 1:
                seq_len = ctx + end - start
                blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
                q_pos = torch.arange(ctx, seq_len, device=device)
                hidden = torch.arange(seq_len, device=device)[None, :] > q_pos[:, None]
                prefills.append(PrefillSeq(start, end, blocks, _additive_mask(hidden, dtype)))

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
            if groups and (
                budget is None
                or (len(groups[-1]) + 1) * (context_lens[i] + 1) * token_bytes <= budget
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        plan = [
            cls._decode_group(meta, group, starts, context_lens, block_size, dtype)
            for group in groups
        ]
        return cls(plan, prefills)

    @staticmethod
    def _decode_group(
        meta: AttentionMetadata,
        seqs: list[int],
        starts: list[int],
        context_lens: list[int],
        block_size: int,
        dtype: torch.dtype,
    ) -> DecodeGroup:
        device = meta.block_tables.device
        index = _as_index(seqs, device)
        num_blocks = -(-(context_lens[seqs[-1]] + 1) // block_size)
        # Padding entries (0 or -1) read some block's keys; the mask hides them.
        tables = meta.block_tables[index, :num_blocks].clamp(min=0).long()
        key_pos = torch.arange(num_blocks * block_size, device=device)
        hidden = key_pos[None, :] >= meta.seq_lens[index][:, None]
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


class TorchAttentionBackend:
    """Reference backend in plain torch (CPU, and a correctness oracle for the kernels).

    On CPU fp32, with duet's CPU extension built (`gpu_worker.ops.cpu_ops`), decode rows and
    the KV write go to its kernels instead; otherwise (and always for prefill rows) it is
    plain torch.
    """

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if _write_kernel_applies(k, v, kv_cache, slot_mapping):
            # One call, a memcpy per row: ~1 us against ~7 us for the two index_copy_ below
            # at one token (10x at 32), 30 layers a step.
            cpu_ops.write_kv(k, v, kv_cache, slot_mapping)
            return
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        # A view over (blocks, offsets) flattened into slots; writes land in the cache itself.
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        kernel = _decode_kernel_applies(q, kv_cache, meta)
        if kernel and meta.is_pure_decode and q.shape[0] == meta.num_seqs:
            # One query per sequence, row i = sequence i: the whole batch in one call, and
            # no plan (its per-step index and mask tensors cost more than they save here).
            return cpu_ops.paged_decode_attention(
                _rows_contiguous(q), kv_cache, meta.block_tables, meta.seq_lens, scale
            )
        plan = meta.torch_plan
        if plan is None:
            plan = meta.torch_plan = TorchAttentionPlan.build(meta, kv_cache, q.dtype, kernel)
        if not plan.prefills and len(plan.decode) == 1:
            group = plan.decode[0]
            if isinstance(group.rows, slice) and group.rows == slice(0, q.shape[0]):
                return self._decode(q, kv_cache, group, scale)  # one group, every row
        out = torch.empty_like(q)
        if plan.kernel_decodes is not None:
            dec = plan.kernel_decodes
            out[dec.rows] = cpu_ops.paged_decode_attention(
                _rows_contiguous(q[dec.rows]), kv_cache, dec.block_tables, dec.seq_lens, scale
            )
        for group in plan.decode:
            out[group.rows] = self._decode(q[group.rows], kv_cache, group, scale)
        for seq in plan.prefills:
            out[seq.start : seq.end] = self._prefill(q, k, v, kv_cache, seq, scale)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:
        # Gather the group's blocks (keys and values in one op), padded to its longest
        # sequence with the tail masked, so the group is one SDPA call.
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        batch = group.mask.shape[0]
        kv = _gather_blocks(kv_cache, group.block_ids)
        keys, values = kv.view(2, batch, -1, num_kv_heads, head_dim).transpose(2, 3).unbind(0)
        # q head h reads kv head h // group, so [batch, heads, dim] viewed as [batch,
        # kv_heads, group, dim] lines each kv head up with its queries: no GQA expansion.
        out = F.scaled_dot_product_attention(
            q.reshape(batch, num_kv_heads, -1, head_dim),
            keys,
            values,
            attn_mask=group.mask,
            scale=scale,
        )
        return out.reshape(batch, -1, head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        seq: PrefillSeq,
        scale: float,
    ) -> torch.Tensor:
        queries = q[seq.start : seq.end].transpose(0, 1)  # [heads, q_len, dim]
        if seq.block_ids is None:
            # No cached context: the keys are this step's own, and the mask is causal.
            out = F.scaled_dot_product_attention(
                queries,
                k[seq.start : seq.end].transpose(0, 1),
                v[seq.start : seq.end].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            return out.transpose(0, 1)
        assert seq.mask is not None
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        seq_len = seq.mask.shape[1]
        kv = _gather_blocks(kv_cache, seq.block_ids).view(2, -1, num_kv_heads, head_dim)[
            :, :seq_len
        ]
        keys, values = kv.transpose(1, 2).unbind(0)  # [kv_heads, seq_len, dim] each
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=seq.mask, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)


def _decode_kernel_applies(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> bool:
    """Whether `cpu_ops.paged_decode_attention` takes this step's decodes: CPU fp32 tensors,
    the extension built, and the metadata in the int32 layout it reads."""
    return (
        cpu_ops.available(q)
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
        and meta.block_tables.dtype == torch.int32
        and meta.seq_lens.dtype == torch.int32
        and meta.block_tables.is_contiguous()
    )


def _write_kernel_applies(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Whether `cpu_ops.write_kv` can store this step's k/v: CPU fp32 throughout, each
    row's [kv_heads, head_dim] dense (rows themselves may be strided views of QKV)."""
    return (
        cpu_ops.available(k)
        and v.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and _rows_dense(k)
        and _rows_dense(v)
    )


def _rows_dense(t: torch.Tensor) -> bool:
    """Each row's [heads, head_dim] is dense, though rows may be strided (views of the
    fused QKV output): the layout the CPU kernels read."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def _rows_contiguous(q: torch.Tensor) -> torch.Tensor:
    return q if _rows_dense(q) else q.contiguous()


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys and values of `block_ids` [n] -> [2, n, block_size * kv_heads * head_dim].

    index_select over whole blocks copies each as one contiguous run; advanced indexing
    (`kv_cache[:, ids]`) walks them element by element and took twice as long on CPU.
    """
    return kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, block_ids)


def get_attention_backend(name: str) -> AttentionBackend:
    """Backend by name: "torch" (reference, any device) or "triton" (CUDA kernels)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
