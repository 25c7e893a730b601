"""Attention backends over a paged KV cache.

The model is written once against `AttentionBackend`; the batch it sees is flattened (prefill
chunks of several sequences and single-token decodes side by side), and `AttentionMetadata`
says which tokens belong to which sequence and where their K/V live in the cache.

KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Cache slot `s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        if meta.is_pure_decode:
            return self._decode(q, kv_cache, meta, scale)
        return self._mixed(q, kv_cache, meta, scale)

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # All sequences have one query: gather every block table at once, pad to the longest
        # sequence and mask the tail, so the whole batch is one SDPA call.
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        num_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:, :num_blocks].clamp(min=0).long()
        batch = tables.shape[0]
        keys = kv_cache[0][tables].reshape(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1][tables].reshape(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        key_pos = torch.arange(keys.shape[2], device=q.device)
        mask = key_pos[None, :] < meta.seq_lens[:, None]  # [batch, keys]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [batch, heads, 1, dim]
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _mixed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        context_lens = meta.context_lens.tolist()
        for i, (seq_len, ctx) in enumerate(zip(seq_lens, context_lens, strict=True)):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            table = meta.block_tables[i, : -(-seq_len // block_size)].long()
            keys = kv_cache[0][table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            values = kv_cache[1][table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            # Query j sits at absolute position ctx + j and sees keys 0..ctx + j.
            q_pos = torch.arange(ctx, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            seq_out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),  # [heads, q_len, dim]
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = seq_out.transpose(0, 1)
        return out


def get_attention_backend(name: str) -> AttentionBackend:
    """Backend by name: "torch" (reference, any device) or "triton" (CUDA kernels)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        raise NotImplementedError(
            "the triton attention backend is not written yet (kernels/paged_attention.py, "
            "kernels/prefill_attention.py); use attention backend 'torch'"
        )
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
