"""The Triton attention backend: the same interface as TorchAttentionBackend, backed by
duet's kernels (kernels/cache_ops.py, paged_attention.py, prefill_attention.py).

Kernels are imported when the backend is built, not with this module: Triton decides at
decoration time whether to compile or interpret, and tests set TRITON_INTERPRET first.
"""

from __future__ import annotations

import logging
import time

import torch

from gpu_worker.attention.backend import AttentionModelConfig, attention_variants
from gpu_worker.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


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

    def tune(
        self,
        model_config: AttentionModelConfig,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        """Launch both attention kernels once per autotune key (kernels/tuning.py) and per
        window/soft-cap variant of the model's layers, on the real cache (read only), so
        Triton benchmarks and caches every config choice now. Under the interpreter there
        is no autotuner: nothing to do."""
        import triton

        from kernels import is_interpreting, num_sms
        from kernels.paged_attention import PROGRAMS_PER_SM
        from kernels.tuning import decode_tune_shapes, prefill_tune_shapes

        if is_interpreting() or kv_cache.device.type != "cuda":
            return
        _, num_blocks, page_size, num_kv_heads, head_dim = kv_cache.shape
        group = model_config.num_heads // model_config.num_kv_heads
        num_heads = num_kv_heads * group  # this rank's heads under tensor parallelism
        device, dtype = kv_cache.device, kv_cache.dtype
        target = PROGRAMS_PER_SM * num_sms(device)
        began = time.perf_counter()
        launches = 0
        for window, softcap in attention_variants(model_config):
            decode_shapes = decode_tune_shapes(
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                page_size=page_size,
                num_kv_heads=num_kv_heads,
                cache_tokens=num_blocks * page_size,
                num_programs_target=target,
                window=window,
            )
            for shape in decode_shapes:
                # Each row its own blocks where the cache has enough, so rows do not share
                # what they read through L2 (which would flatter a config).
                ids = torch.arange(shape.num_seqs * shape.num_blocks, device=device)
                tables = (ids % num_blocks).view(shape.num_seqs, -1).to(torch.int32)
                seq_lens = torch.full(
                    (shape.num_seqs,), shape.seq_len, dtype=torch.int32, device=device
                )
                q = torch.randn(shape.num_seqs, num_heads, head_dim, device=device, dtype=dtype)
                self._decode(q, kv_cache, tables, seq_lens, 1.0, window=window, softcap=softcap)
            prefill_shapes = prefill_tune_shapes(
                max_num_batched_tokens=max_num_batched_tokens,
                group_pad=triton.next_power_of_2(group),
            )
            for p in prefill_shapes:
                blocks = triton.cdiv(p.query_len, page_size)
                ids = torch.arange(p.num_seqs * blocks, device=device)
                tables = (ids % num_blocks).view(p.num_seqs, -1).to(torch.int32)
                lens = torch.full((p.num_seqs,), p.query_len, dtype=torch.int32, device=device)
                starts = torch.arange(p.num_seqs + 1, dtype=torch.int32, device=device)
                tokens = p.num_seqs * p.query_len
                q = torch.randn(tokens, num_heads, head_dim, device=device, dtype=dtype)
                self._prefill(
                    q, kv_cache, tables, starts * p.query_len, lens, torch.zeros_like(lens),
                    p.query_len, 1.0, window=window, softcap=softcap,
                )  # fmt: skip
            launches += len(decode_shapes) + len(prefill_shapes)
        torch.cuda.synchronize(device)
        logger.info(
            "attention autotuned: %d shapes in %.1f s", launches, time.perf_counter() - began
        )

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
