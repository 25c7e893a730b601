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
class TorchAttentionPlan:
    """What every layer of one step does, worked out once from the metadata.

    Sequences with one query token (decodes) run as one batched SDPA call; longer ones
    (prefill chunks) run one call each. Index tensors and masks are shared by all layers.
    """

    decode_rows: slice | torch.Tensor | None
    """Rows of the decode tokens in the batch: a slice when contiguous (the scheduler
    puts running sequences first), else an index; None when there are none."""
    decode_block_ids: torch.Tensor | None
    """[num_decodes, num_blocks] int64 block tables, cut to the longest decode."""
    decode_mask: torch.Tensor | None
    """[num_decodes, 1, 1, num_blocks * block_size] additive (0 / -inf): keys past each
    sequence's length are hidden."""
    prefills: list[PrefillSeq]

    @classmethod
    def build(
        cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype
    ) -> TorchAttentionPlan:
        """Plan the step for a cache of `block_size`-token blocks and queries of `dtype`."""
        # Host copies when the builder passed them: no device read-back on CUDA.
        starts = meta.query_start_loc_host
        if starts is None:
            starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens_host
        if context_lens is None:
            context_lens = meta.context_lens.tolist()
        device = meta.block_tables.device
        decode_seqs: list[int] = []
        decode_rows: list[int] = []
        prefills: list[PrefillSeq] = []
        for i, ctx in enumerate(context_lens):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                decode_seqs.append(i)
                decode_rows.append(start)
            elif end - start > 1 and ctx == 0:
                prefills.append(PrefillSeq(start, end, None, None))
            elif end - start > 1:
                seq_len = ctx + end - start
                blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
                q_pos = torch.arange(ctx, seq_len, device=device)
                hidden = torch.arange(seq_len, device=device)[None, :] > q_pos[:, None]
                prefills.append(PrefillSeq(start, end, blocks, _additive_mask(hidden, dtype)))
        if not decode_seqs:
            return cls(None, None, None, prefills)

        seqs = _as_index(decode_seqs, device)
        max_len = max(context_lens[i] for i in decode_seqs) + 1
        num_blocks = -(-max_len // block_size)
        # Padding entries (0 or -1) read some block's keys; the mask hides them.
        tables = meta.block_tables[seqs, :num_blocks].clamp(min=0).long()
        key_pos = torch.arange(num_blocks * block_size, device=device)
        hidden = key_pos[None, :] >= meta.seq_lens[seqs][:, None]
        mask = _additive_mask(hidden, dtype)
        return cls(_as_index(decode_rows, device), tables, mask[:, None, None, :], prefills)


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
    """Reference backend in plain torch (CPU, and a correctness oracle for the kernels)."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
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
        plan = meta.torch_plan
        if plan is None:
            plan = meta.torch_plan = TorchAttentionPlan.build(meta, kv_cache.shape[2], q.dtype)
        if not plan.prefills:
            if plan.decode_rows is None:  # no tokens at all
                return torch.empty_like(q)
            return self._decode(q, kv_cache, plan, scale)  # every row is a decode
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], kv_cache, plan, scale)
        for seq in plan.prefills:
            out[seq.start : seq.end] = self._prefill(q, k, v, kv_cache, seq, scale)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: TorchAttentionPlan, scale: float
    ) -> torch.Tensor:
        # Gather every decode's blocks at once (keys and values in one op), pad to the
        # longest and mask the tail, so the whole batch is one SDPA call.
        tables = plan.decode_block_ids
        assert tables is not None
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        batch = tables.shape[0]
        kv = _gather_blocks(kv_cache, tables.view(-1)).view(2, batch, -1, num_kv_heads, head_dim)
        keys, values = kv.transpose(2, 3).unbind(0)  # [batch, kv_heads, keys, dim] each
        # q head h reads kv head h // group, so [batch, heads, dim] viewed as [batch,
        # kv_heads, group, dim] lines each kv head up with its queries: no GQA expansion.
        out = F.scaled_dot_product_attention(
            q.reshape(batch, num_kv_heads, -1, head_dim),
            keys,
            values,
            attn_mask=plan.decode_mask,
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
        from gpu_worker.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
