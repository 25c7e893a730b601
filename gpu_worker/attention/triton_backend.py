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
        """Launch both attention kernels once per autotune key and per window/soft-cap
        variant of the model's layers (`launch_tuning_shapes`), so Triton benchmarks and
        caches every config choice now. Under the interpreter, or on CPU tensors, there is
        no autotuner: nothing to do."""
        from kernels import is_interpreting, num_sms
        from kernels.paged_attention import PROGRAMS_PER_SM

        if is_interpreting() or kv_cache.device.type != "cuda":
            return
        began = time.perf_counter()
        launches = self.launch_tuning_shapes(
            model_config,
            kv_cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            num_programs_target=PROGRAMS_PER_SM * num_sms(kv_cache.device),
        )
        torch.cuda.synchronize(kv_cache.device)
        logger.info(
            "attention autotuned: %d launches in %.1f s", launches, time.perf_counter() - began
        )

    def launch_tuning_shapes(
        self,
        model_config: AttentionModelConfig,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_programs_target: int,
    ) -> int:
        """Run the decode and prefill kernels over `kernels.tuning`'s shapes, per variant,
        on the real cache (read only: rows point at its blocks, nothing is written); returns
        the number of launches. The kernels' outputs are discarded."""
        import triton

        from kernels.tuning import decode_tune_shapes, prefill_tune_shapes

        _, num_blocks, page_size, num_kv_heads, head_dim = kv_cache.shape
        group = model_config.num_heads // model_config.num_kv_heads
        num_heads = num_kv_heads * group  # this rank's heads under tensor parallelism
        group_pad = triton.next_power_of_2(group)
        launches = 0
        for window, softcap in attention_variants(model_config):
            for d in decode_tune_shapes(
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                page_size=page_size,
                num_kv_heads=num_kv_heads,
                cache_tokens=num_blocks * page_size,
                num_programs_target=num_programs_target,
                window=window,
            ):
                tables = _spread_tables(d.num_seqs, d.num_blocks, num_blocks, kv_cache.device)
                seq_lens = torch.full_like(tables[:, 0], d.seq_len)
                q = kv_cache.new_empty(d.num_seqs, num_heads, head_dim).normal_()
                self._decode(q, kv_cache, tables, seq_lens, 1.0, window=window, softcap=softcap)
                launches += 1
            for p in prefill_tune_shapes(
                max_num_batched_tokens=max_num_batched_tokens, group_pad=group_pad
            ):
                query_lens = p.query_lens()
                width = triton.cdiv(p.query_len, page_size)
                tables = _spread_tables(len(query_lens), width, num_blocks, kv_cache.device)
                lens = torch.tensor(query_lens, dtype=torch.int32, device=kv_cache.device)
                starts = torch.cat((lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)))
                q = kv_cache.new_empty(p.num_tokens, num_heads, head_dim).normal_()
                self._prefill(
                    q, kv_cache, tables, starts, lens, torch.zeros_like(lens), p.query_len, 1.0,
                    window=window, softcap=softcap,
                )  # fmt: skip
                launches += 1
        return launches

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


def _spread_tables(
    num_rows: int, width: int, num_blocks: int, device: torch.device
) -> torch.Tensor:
    """Block tables whose rows read different blocks where the cache has enough, so that
    rows do not share what they read through L2 (which would flatter a config)."""
    ids = torch.arange(num_rows * width, device=device) % num_blocks
    return ids.view(num_rows, width).to(torch.int32)
