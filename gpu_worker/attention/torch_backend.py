"""The reference attention backend in plain torch (CPU, and a correctness oracle for the
Triton kernels); on CPU fp32 with duet's CPU extension built, decodes and the KV write go
to its kernels (`gpu_worker.ops.cpu_ops`).

The KV cache may hold a narrower dtype than the model's (--kv-cache-dtype): keys and values
are rounded to it when stored, and every read, the fresh prefill's own k/v included, sees
the stored values in the queries' dtype. So a prefix computed now and the same prefix read
from the cache later attend alike, as the Triton kernels (which read every key from the
cache) do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention.backend import AttentionModelConfig
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.attention.torch_plan import DecodeGroup, PrefillSeq, TorchAttentionPlan
from gpu_worker.ops import cpu_ops


class TorchAttentionBackend:
    """Reference backend in plain torch (CPU, and a correctness oracle for the kernels).

    On CPU with fp32 queries over an fp32, bf16 or fp16 cache, with duet's CPU extension
    built (`gpu_worker.ops.cpu_ops`), decode rows and the KV write go to its kernels
    instead; otherwise (and always for prefill rows) it is plain torch. `plan` works out
    each step's grouping once (`TorchAttentionPlan`); every layer's `forward` then reuses
    it.
    """

    def __init__(self, query_dtype: torch.dtype | None = None) -> None:
        self.query_dtype = query_dtype
        """The model's dtype, which `plan` builds masks for and picks kernels by; None: the
        cache's (a query of another dtype then re-plans its step once, in `forward`)."""
        self.step_plan: TorchAttentionPlan | None = None
        """This step's plan; None when the CPU kernel takes a whole pure-decode batch, which
        needs no index or mask tensors (they would cost more than they save there)."""
        self._planned: AttentionMetadata | None = None
        self._planned_dtype: torch.dtype | None = None
        self._window_plans: dict[int | None, TorchAttentionPlan] = {}
        """This step's plans of sliding-window layers, by window, built by the first
        layer with that window: the masks differ, and the CPU kernel has no window. Under
        None, the plan of soft-capped global layers when the CPU kernel (which has no
        soft-capping either) takes the decodes of `step_plan`."""

    def tune(
        self,
        model_config: AttentionModelConfig,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        """Nothing to tune: plain torch and the CPU kernels have no autotuned parameters."""

    def plan(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        self._plan(meta, kv_cache, self.query_dtype or kv_cache.dtype)

    def _plan(self, meta: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
        kernel = _decode_kernel_applies(kv_cache, meta, dtype)
        if kernel and meta.is_pure_decode and meta.num_tokens == meta.num_seqs:
            self.step_plan = None  # one query per sequence, row i = sequence i: one call
        else:
            self.step_plan = TorchAttentionPlan.build(meta, kv_cache, dtype, kernel)
        self._window_plans.clear()
        self._planned = meta
        self._planned_dtype = dtype

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if _write_kernel_applies(k, v, kv_cache, slot_mapping):
            # One call, a memcpy per row, instead of the two index_copy_ below, 30 layers a
            # step (timed in bench/RESULTS.md, CPU kernels).
            cpu_ops.write_kv(k, v, kv_cache, slot_mapping)
            return
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        # A view over (blocks, offsets) flattened into slots; writes land in the cache itself.
        cache_dtype = kv_cache.dtype
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(cache_dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(cache_dtype))

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
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        if meta is not self._planned:
            raise RuntimeError("TorchAttentionBackend.plan(meta) was not called for this step")
        if q.dtype != self._planned_dtype:  # not told the model's dtype: plan for this one
            self._plan(meta, kv_cache, q.dtype)
        # A window no shorter than the longest sequence hides nothing: the global plan.
        if window is None or window >= meta.max_seq_len:
            window = None
        kernel = self.step_plan is None or self.step_plan.kernel_decodes is not None
        if window is not None or (softcap is not None and kernel):
            plan = self._window_plans.get(window)
            if plan is None:
                plan = TorchAttentionPlan.build(meta, kv_cache, q.dtype, window=window)
                self._window_plans[window] = plan
        elif self.step_plan is None:
            return cpu_ops.paged_decode_attention(
                _rows_contiguous(q), kv_cache, meta.block_tables, meta.seq_lens, scale
            )
        else:
            plan = self.step_plan
        if not plan.prefills and len(plan.decode) == 1:
            group = plan.decode[0]
            if isinstance(group.rows, slice) and group.rows == slice(0, q.shape[0]):
                return self._decode(q, kv_cache, group, scale, softcap)  # one group, every row
        out = torch.empty_like(q)
        if plan.kernel_decodes is not None:
            dec = plan.kernel_decodes
            out[dec.rows] = cpu_ops.paged_decode_attention(
                _rows_contiguous(q[dec.rows]), kv_cache, dec.block_tables, dec.seq_lens, scale
            )
        for group in plan.decode:
            out[group.rows] = self._decode(q[group.rows], kv_cache, group, scale, softcap)
        for seq in plan.prefills:
            out[seq.start : seq.end] = self._prefill(q, k, v, kv_cache, seq, scale, softcap)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        # Gather the group's blocks (keys and values in one op), padded to its longest
        # sequence with the tail masked, so the group is one SDPA call.
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        batch = group.mask.shape[0]
        kv = _gather_blocks(kv_cache, group.block_ids).to(q.dtype)
        keys, values = kv.view(2, batch, -1, num_kv_heads, head_dim).transpose(2, 3).unbind(0)
        # q head h reads kv head h // group, so [batch, heads, dim] viewed as [batch,
        # kv_heads, group, dim] lines each kv head up with its queries: no GQA expansion.
        out = _attention(
            q.reshape(batch, num_kv_heads, -1, head_dim),
            keys,
            values,
            group.mask,
            scale,
            softcap,
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
        softcap: float | None,
    ) -> torch.Tensor:
        queries = q[seq.start : seq.end].transpose(0, 1)  # [heads, q_len, dim]
        if seq.block_ids is None:
            # No cached context: the keys are this step's own (as the cache holds them);
            # causal, or the window's mask.
            out = _attention(
                queries,
                _as_stored(k[seq.start : seq.end], kv_cache.dtype).transpose(0, 1),
                _as_stored(v[seq.start : seq.end], kv_cache.dtype).transpose(0, 1),
                seq.mask,
                scale,
                softcap,
                gqa=True,
            )
            return out.transpose(0, 1)
        assert seq.mask is not None
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        seq_len = seq.mask.shape[1]
        kv = (
            _gather_blocks(kv_cache, seq.block_ids)
            .view(2, -1, num_kv_heads, head_dim)[:, :seq_len]
            .to(q.dtype)
        )
        keys, values = kv.transpose(1, 2).unbind(0)  # [kv_heads, seq_len, dim] each
        out = _attention(queries, keys, values, seq.mask, scale, softcap, gqa=True)
        return out.transpose(0, 1)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    gqa: bool = False,
) -> torch.Tensor:
    """SDPA over [..., heads, len, dim], causal without an additive `mask`; with `softcap`
    the scores are capped first, which SDPA cannot do: then transformers' eager attention,
    op for op (scores and cap in the query dtype, softmax in fp32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
    if gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    else:
        scores = scores + mask
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def _as_stored(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`t` as the cache holds it (rounded to `cache_dtype`), in its own dtype."""
    return t if t.dtype == cache_dtype else t.to(cache_dtype).to(t.dtype)


def _decode_kernel_applies(
    kv_cache: torch.Tensor, meta: AttentionMetadata, query_dtype: torch.dtype
) -> bool:
    """Whether `cpu_ops.paged_decode_attention` takes this step's decodes: fp32 queries
    over a CPU cache of fp32, bf16 or fp16, the extension built, and the metadata in the
    int32 layout it reads."""
    return (
        query_dtype == torch.float32
        and cpu_ops.kv_cache_available(kv_cache)
        and kv_cache.is_contiguous()
        and meta.block_tables.dtype == torch.int32
        and meta.seq_lens.dtype == torch.int32
        and meta.block_tables.is_contiguous()
    )


def _write_kernel_applies(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Whether `cpu_ops.write_kv` can store this step's k/v: CPU fp32 k/v into a cache of
    fp32, bf16 or fp16, each row's [kv_heads, head_dim] dense (rows themselves may be
    strided views of QKV)."""
    return (
        cpu_ops.available(k)
        and v.dtype == torch.float32
        and cpu_ops.kv_cache_available(kv_cache)
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
