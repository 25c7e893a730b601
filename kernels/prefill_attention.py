"""Prefill attention over a paged prefix: variable-length packed queries, causal, GQA.

Sequence i owns the packed query tokens `query_start_loc[i]:query_start_loc[i + 1]`; its token j
sits at position `context_lens[i] + j` and sees every key up to that position: the cached prefix
in full and its own new tokens causally. All keys, prefix and new alike, are read from the paged
cache, so the new tokens' K/V must be written first (`kernels.cache_ops.write_kv_cache`). A
decode is a query of length 1, so one launch serves a whole mixed batch.

Tiling: one program takes BLOCK_Q query tokens of one sequence times the GROUP query heads of
one KV head, as the BLOCK_M = BLOCK_Q * GROUP_PAD rows of one tile (row r is token r // GROUP_PAD,
head r % GROUP_PAD), so K/V tiles are loaded once per KV head. Keys below the tile's first query
position need no mask; only the last few key tiles apply the causal mask. With a sliding window
(the query at p sees keys p - window < k <= p) the tile starts at its first row's window: key
tiles wholly before it are never loaded, and only the first few apply the window mask.

Sequence i owns the query tiles from `query_start_loc[i] // BLOCK_Q + i` on, which gives every
sequence at least `ceil(len / BLOCK_Q)` tiles within a grid of `num_tokens // BLOCK_Q + num_seqs`
programs per KV head; a program finds its sequence by binary search and exits if it has no
tokens. The grid depends only on shapes (CUDA-graph safe) and needs no host sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kernels import (
    check_attention_inputs,
    check_launchable,
    check_lengths,
    dot_precision,
    tuning_bench,
)
from kernels.paged_attention import LOG2E, check_softcap, check_window, softcap_log2

MAX_BLOCK_M = 128
MIN_TOKENS_BUCKET = 16
INTERPRETER_BLOCK_N = 32

_PREFILL_CONFIGS = [
    triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
    for block_n in (32, 64, 128)
    for warps in (4, 8)
    for stages in (2, 3)
]


def _prune_configs(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """A 128-row tile needs 8 warps (its fp32 accumulator spills with 4); a tile of 32 rows or
    fewer (decodes, short chunks) gains nothing from 8."""
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    assert block_m is not None, "BLOCK_M is a launch argument of every prefill kernel"
    if block_m >= 128:
        return [c for c in configs if c.num_warps == 8]
    if block_m <= 32:
        return [c for c in configs if c.num_warps == 4]
    return configs


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first tile, query_start_loc[i] // BLOCK_Q + i, is <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_base,
    v_base,
    table,
    lo,
    hi,
    seq_len,
    window,
    scale_log2,
    stride_cb,
    stride_ct,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax over keys [lo, hi); MASKED applies the causal, length and (with
    HAS_WINDOW) window masks; SOFTCAP > 0 caps the scores first."""
    offs_d = tl.arange(0, HEAD_DIM)
    # Block ids run one tile ahead of the K/V loads (as in the decode kernel): addresses that
    # hang on a load of the same iteration keep Triton's pipeliner to a single buffer.
    offs_n = lo + tl.arange(0, BLOCK_N)
    block = tl.load(table + offs_n // PAGE_SIZE, mask=offs_n < hi, other=0).to(tl.int64)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = block * stride_cb + (offs_n % PAGE_SIZE) * stride_ct
        next_n = offs_n + BLOCK_N
        block = tl.load(table + next_n // PAGE_SIZE, mask=next_n < hi, other=0).to(tl.int64)
        if MASKED:
            n_mask = offs_n < seq_len
            k = tl.load(k_base + slot[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_base + slot[:, None] + offs_d[None, :])
        # A cache of another dtype than the queries' (--kv-cache-dtype) is read in theirs.
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0:
            qk = softcap_log2(qk, SOFTCAP)
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # With a window a row may see none of a masked tile's keys: m_new is then -inf, and
        # subtracting 0 instead keeps alpha and p at 0 rather than NaN. Without one the first
        # tile holds key `lo` <= every row's position, and unmasked tiles are visible to
        # every row: m_new is finite.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED and HAS_WINDOW else m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(v_base + slot[:, None] + offs_d[None, :])
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Ints that vary from step to step are not specialized: Triton compiles a variant per int
# argument that is 1 or a multiple of 16, which would compile on a request. The block-table
# width (stride_bts) follows the step; tokens_bucket is only an autotune key.
PREFILL_UNSPECIALIZED = ["num_seqs", "num_tiles", "window", "tokens_bucket", "stride_bts"]


@triton.jit(do_not_specialize=PREFILL_UNSPECIALIZED)
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    context_lens_ptr,
    num_seqs,
    num_tiles,
    window,
    tokens_bucket,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):
    # Last tiles first: within a sequence they see the most keys, so they should start early.
    tile = num_tiles - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    t0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if t0 >= q_len:
        return
    # int32 whichever width the lengths come in, so loop-carried offsets keep one type.
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = t0 + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    heads = kv_head * GROUP + head_in_group
    row_mask = (tok < q_len) & (head_in_group < GROUP)
    q_pos = context_len + tok
    q_offs = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_offs[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch

    # Keys [full_start, full_end) are at or before the tile's first position and, with a
    # window, inside the last row's window: visible to every row. Keys before full_start
    # (down to the first row's window) and from full_end on are masked.
    first_pos = context_len + t0
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    last_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    full_start = 0
    if HAS_WINDOW:
        window_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        last_pos = first_pos + BLOCK_Q - 1
        full_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_start = tl.minimum(full_start, full_end)
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, q_pos, k_base, v_base, table, window_lo, full_start, seq_len,
            window, scale_log2, stride_cb, stride_ct, PAGE_SIZE, HEAD_DIM, BLOCK_N, True, True,
            DOT_PRECISION, SOFTCAP,
        )  # fmt: skip
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, k_base, v_base, table, full_start, full_end, seq_len, window,
        scale_log2, stride_cb, stride_ct, PAGE_SIZE, HEAD_DIM, BLOCK_N, False, HAS_WINDOW,
        DOT_PRECISION, SOFTCAP,
    )  # fmt: skip
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, k_base, v_base, table, full_end, last_end, seq_len, window,
        scale_log2, stride_cb, stride_ct, PAGE_SIZE, HEAD_DIM, BLOCK_N, True, HAS_WINDOW,
        DOT_PRECISION, SOFTCAP,
    )  # fmt: skip

    if HAS_WINDOW:
        # Padding rows past the sequence's last token may see no key of their window.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_i[:, None]
    o_offs = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + o_offs[:, None] + offs_d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


# Every constexpr that changes the compiled code is a key, so each variant is tuned on its
# own; the step's size enters only as a power-of-two bucket of its token count. The tile
# height (BLOCK_M) is a power of two of the longest query already.
PREFILL_TUNE_KEY = [
    "HEAD_DIM",
    "GROUP_PAD",
    "PAGE_SIZE",
    "BLOCK_M",
    "HAS_WINDOW",
    "SOFTCAP",
    "tokens_bucket",
]
_paged_prefill_kernel_tuned = triton.autotune(
    configs=_PREFILL_CONFIGS,
    key=PREFILL_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=tuning_bench,
)(_paged_prefill_kernel)


def tokens_bucket(num_tokens: int) -> int:
    """The prefill autotuner's size key: the next power of two, at least MIN_TOKENS_BUCKET
    (smaller steps differ in their tile height, not in their size)."""
    return max(MIN_TOKENS_BUCKET, triton.next_power_of_2(max(num_tokens, 1)))


def choose_block_m(max_query_len: int, group_pad: int) -> int:
    """Rows per tile: enough for the longest query's tokens times the group, 16..128."""
    rows = triton.next_power_of_2(max(max_query_len, 1)) * group_pad
    return max(16, group_pad, min(rows, MAX_BLOCK_M))


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries q `[num_tokens, num_heads, head_dim]` over each
    sequence's cached prefix and its own new tokens, all read from `kv_cache`; with a sliding
    `window`, the query at position p sees keys p - window < k <= p only (None: all keys).
    With `softcap` the scaled scores s become `softcap * tanh(s / softcap)` before the masks.

    `query_start_loc` `[num_seqs + 1]`, `seq_lens` and `context_lens` `[num_seqs]` follow
    `gpu_worker.attention.torch_backend.AttentionMetadata`
    (seq_lens[i] = context_lens[i] + query length).
    `max_query_len` only picks the tile size; any value gives correct results. Returns a new
    contiguous tensor shaped like q.
    """
    on_gpu = check_launchable(q, kv_cache, block_tables, query_start_loc, seq_lens, context_lens)
    check_attention_inputs(q, kv_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    check_lengths("query_start_loc", query_start_loc, num_seqs + 1)
    check_lengths("context_lens", context_lens, num_seqs)
    if block_tables.shape[0] != num_seqs:
        raise ValueError("block_tables must have one row per sequence")
    check_window(window)
    check_softcap(softcap)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = choose_block_m(max_query_len, group_pad)
    block_q = block_m // group_pad  # query tokens per tile
    num_tiles = num_tokens // block_q + num_seqs
    args = (
        q,
        kv_cache[0],
        kv_cache[1],
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        context_lens,
        num_seqs,
        num_tiles,
        window or 0,
        tokens_bucket(num_tokens),
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
    )
    meta = dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HAS_WINDOW=window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=float(softcap or 0.0),
    )
    grid = (num_tiles, num_kv_heads)
    if on_gpu:
        _paged_prefill_kernel_tuned[grid](*args, **meta)
    else:
        _paged_prefill_kernel[grid](*args, **meta, BLOCK_N=INTERPRETER_BLOCK_N)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, in fp32: what `paged_prefill_attention` computes."""
    page_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, (seq_len, ctx) in enumerate(zip(seq_lens.tolist(), context_lens.tolist(), strict=True)):
        start, end = starts[i], starts[i + 1]
        blocks = block_tables[i, : math.ceil(seq_len / page_size)].long()
        keys = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start:end].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx, ctx + end - start, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= q_pos[:, None]
        if window is not None:
            visible &= key_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values).to(q.dtype)
    return out
