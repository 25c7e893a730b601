"""The Triton attention backend: the same interface as TorchAttentionBackend, backed by
duet's kernels (kernels/cache_ops.py, paged_attention.py, prefill_attention.py).

Kernels are imported when the backend is built, not with this module: Triton decides at
decoration time whether to compile or interpret, and tests set TRITON_INTERPRET first.
"""

from __future__ import annotations

import torch

from gpu_worker.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention on Triton kernels: decode-only steps use the split-K decode kernel,
    any step with a prefill chunk uses the varlen prefill kernel (decodes are queries of
    length one there)."""

    def __init__(self) -> None:
        from kernels.cache_ops import write_kv_cache
        from kernels.paged_attention import paged_decode_attention
        from kernels.prefill_attention import paged_prefill_attention

        self._write_kv_cache = write_kv_cache
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention

    def plan(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        """Nothing to prepare: the kernels read the metadata as it is (and a CUDA graph
        replays them with no host work at all)."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self._write_kv_cache(k, v, kv_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        *,
        softcap: float | None = None,
    ) -> torch.Tensor:
        self._write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if meta.is_pure_decode:
            return self._decode(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, window=window, softcap=softcap
            )
        return self._prefill(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.context_lens,
            meta.max_query_len,
            scale,
            window=window,
            softcap=softcap,
        )
