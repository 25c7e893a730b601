"""Paged decode attention: one query token per sequence, K/V read through block tables.

Flash decoding. The grid is (sequence, KV head, split): one program reads one KV head's keys
and values once for ALL the query heads that share it (GQA; the group is padded to 16 rows so
the two products are `tl.dot`s), over one partition of the context. With several splits each
program writes its partition's normalized output and log-sum-exp, and `_combine_splits_kernel`
merges them; with one split the program writes the output directly.

Each sequence's context is cut into partitions of a fixed `split_size` tokens, so a long
sequence among short ones gets as many programs as its length needs instead of becoming the
step's tail; the programs past a sequence's end exit at once. The split size and the grid
depend only on tensor shapes (the batch and the block-table width), never on their contents:
the launcher is safe to capture in a CUDA graph (after a warm-up call per shape, which on a
GPU also runs the autotuner). With a sliding window only the last `window` keys are
partitioned: blocks wholly before it are never loaded.

The key loop is software-pipelined by Triton (cp.async into multi-buffered shared memory):
the block ids of the next tile are loaded one iteration ahead, so the K/V addresses of a tile
never wait on a load of the same iteration, which is what kept the pipeliner to one buffer.

KV cache layout (gpu_worker/attention/torch_backend.py):
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, in the queries' dtype or another
(--kv-cache-dtype: keys and values are converted to the queries' as they are loaded),
0 = keys, 1 = values; token `t` of a sequence sits in block `block_table[t // block_size]`
at offset `t % block_size`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import (
    check_attention_inputs,
    check_launchable,
    check_lengths,
    dot_precision,
    num_sms,
    tuning_bench,
)

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # below this, a split's fixed cost outweighs the parallelism it adds
MAX_SPLIT_TOKENS = 1024  # a long sequence among short ones gets length / 1024 programs a head
MAX_SPLITS = 64  # bounds the grid and the partials: very long contexts get longer splits
PROGRAMS_PER_SM = 4  # aim for this many programs per SM before cutting splits below the cap
INTERPRETER_BLOCK_N = 32  # two 16-token blocks per key tile, so tests cross block boundaries

# Decode is memory-bound: what matters is bytes in flight per SM (tile size x buffers ahead x
# programs per SM). A stage is a shared-memory buffer of 2 * BLOCK_N * HEAD_DIM elements; with
# num_stages >= 3 the loop keeps num_stages - 2 tiles loading while it computes one. At
# HEAD_DIM 128 in bf16 these fit 2-8 programs per SM (ptxas: 56-96 registers a thread).
_DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=4),
]


@triton.jit
def softcap_log2(qk, SOFTCAP: tl.constexpr):
    """Soft-capping of scores already scaled into the log2 domain (`s * LOG2E`):
    `cap * tanh(s / cap) * LOG2E`. tanh from one exp of a non-positive argument, so it
    neither overflows nor loses its sign."""
    log2e: tl.constexpr = 1.4426950408889634  # LOG2E: a kernel reads no plain globals
    x = qk * (1.0 / (SOFTCAP * log2e))
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * (SOFTCAP * log2e)


# Ints that vary from step to step are not specialized: Triton compiles a variant per int
# argument that is 1 or a multiple of 16, which would compile on a request. The block-table
# width (stride_bts) follows eager steps' context; batch_bucket is only an autotune key.
DECODE_UNSPECIALIZED = ["stride_bts", "num_splits", "split_size", "window", "batch_bucket"]


@triton.jit(do_not_specialize=DECODE_UNSPECIALIZED)
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    split_size,
    window,
    batch_bucket,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)  # int64 lengths too: one offset type
    # The query sits at seq_len - 1 and sees keys (seq_len - 1 - window, seq_len - 1]: every
    # key of [first, seq_len) is visible, so the loop below needs no window mask.
    first = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0
    start = first + split * split_size
    end = tl.minimum(start + split_size, seq_len)
    if not SINGLE_SPLIT:  # noqa: SIM102 (a constexpr test: the branch compiles away)
        if start >= end:
            return  # past this sequence's end: the combine reads only the splits that ran

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    q_offs = seq * stride_qs + heads * stride_qh
    q = tl.load(q_ptr + q_offs[:, None] + offs_d[None, :], mask=head_mask[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    # Block ids run one tile ahead of the K/V loads: addresses that hang on a load of the same
    # iteration keep Triton's pipeliner to a single buffer (load, wait, compute, each tile).
    offs_n = start + tl.arange(0, BLOCK_N)
    block = tl.load(table + offs_n // PAGE_SIZE, mask=offs_n < end, other=0).to(tl.int64)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slot = block * stride_cb + (offs_n % PAGE_SIZE) * stride_ct
        next_n = offs_n + BLOCK_N
        block = tl.load(table + next_n // PAGE_SIZE, mask=next_n < end, other=0).to(tl.int64)
        k = tl.load(k_base + slot[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        # A cache of another dtype than the queries' (--kv-cache-dtype) is read in theirs.
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0:
            qk = softcap_log2(qk, SOFTCAP)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # Every tile holds at least one key (n0 < end), so m_new is finite from the first one.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        # An empty sequence (a CUDA graph's padding row) has l_i == 0: it writes zeros.
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = seq * stride_os + heads * stride_oh
        tl.store(
            out_ptr + o_offs[:, None] + offs_d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    else:
        # Partials are contiguous [num_seqs, num_heads, num_splits(, HEAD_DIM)] fp32; this
        # split holds at least one key, so l_i > 0.
        rows = (seq * num_heads + heads) * num_splits + split
        tl.store(part_lse_ptr + rows, m_i + tl.log2(l_i), mask=head_mask)
        tl.store(
            part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
            acc / l_i[:, None],
            mask=head_mask[:, None],
        )


# Every constexpr that changes the compiled code is a key, so each variant is tuned on its
# own; the lengths enter only bucketed (split_size is a power of two, batch_bucket one too).
DECODE_TUNE_KEY = [
    "HEAD_DIM",
    "GROUP_PAD",
    "PAGE_SIZE",
    "SINGLE_SPLIT",
    "HAS_WINDOW",
    "SOFTCAP",
    "split_size",
    "batch_bucket",
]
_paged_decode_kernel_tuned = triton.autotune(
    configs=_DECODE_CONFIGS, key=DECODE_TUNE_KEY, do_bench=tuning_bench
)(_paged_decode_kernel)


@triton.jit(do_not_specialize=["num_splits", "split_size", "window"])  # as above
def _combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    split_size,
    window,
    HAS_WINDOW: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)  # int64 lengths too: one offset type
    first = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0
    # The splits that held keys; the rest exited without writing. None for an empty
    # sequence (a CUDA graph's padding row): it gets zeros.
    num_valid = tl.cdiv(seq_len - first, split_size)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_valid
    rows = (seq * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + rows, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.where(split_mask, tl.exp2(lse - m), 0.0)
    total = tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    result = tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        result.to(out_ptr.dtype.element_ty),
    )


def check_window(window: int | None) -> None:
    """A sliding window sees at least the query's own key."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")


def check_softcap(softcap: float | None) -> None:
    """A cap is a positive scale (0 would be the kernels' "off")."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


def choose_split_size(
    num_seqs: int, num_kv_heads: int, max_context: int, num_programs_target: int
) -> int:
    """Tokens per split, a power of two: small enough that the batch fills the GPU with
    programs (`num_programs_target`) if every sequence were `max_context` long, never more
    than MAX_SPLIT_TOKENS (so one long sequence among short ones is spread too), never less
    than MIN_SPLIT_TOKENS, and large enough for at most MAX_SPLITS splits."""
    wanted = triton.cdiv(num_programs_target, max(num_seqs * num_kv_heads, 1))
    size = min(triton.next_power_of_2(triton.cdiv(max(max_context, 1), wanted)), MAX_SPLIT_TOKENS)
    floor = triton.next_power_of_2(triton.cdiv(max(max_context, 1), MAX_SPLITS))
    return max(size, MIN_SPLIT_TOKENS, floor)


def decode_context(block_tables: torch.Tensor, page_size: int, window: int | None) -> int:
    """The most keys any query of the batch can see, from shapes only: the block-table width,
    or the window when it is shorter."""
    max_context = block_tables.shape[1] * page_size
    return max_context if window is None else min(max_context, window)


def batch_bucket(num_seqs: int) -> int:
    """The decode autotuner's batch key: the next power of two."""
    return triton.next_power_of_2(max(num_seqs, 1))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    split_size: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention: q `[num_seqs, num_heads, head_dim]` (one token per sequence) attends to
    the first `seq_lens[i]` cached tokens of sequence i (the new token's K/V already written),
    or with a sliding `window` to the last `window` of them only (transformers' convention:
    the query at p sees keys p - window < k <= p; None attends to all). With `softcap` the
    scaled scores s become `softcap * tanh(s / softcap)` (Gemma 2); each cap compiles once.

    `block_tables` is `[num_seqs, max_blocks]` (padding never read); `split_size` (tokens per
    split-K partition) overrides `choose_split_size`. Returns a new contiguous tensor shaped
    like q.
    """
    on_gpu = check_launchable(q, kv_cache, block_tables, seq_lens)
    check_attention_inputs(q, kv_cache, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    if block_tables.shape[0] != num_seqs:
        raise ValueError("block_tables must have one row per sequence of q")
    check_lengths("seq_lens", seq_lens, num_seqs)
    check_window(window)
    check_softcap(softcap)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out

    max_context = decode_context(block_tables, page_size, window)
    if split_size is None:
        sms = num_sms(q.device) if on_gpu else 4
        split_size = choose_split_size(num_seqs, num_kv_heads, max_context, PROGRAMS_PER_SM * sms)
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    num_splits = triton.cdiv(max(max_context, 1), split_size)
    if num_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused: the kernel writes `out` directly

    group = num_heads // num_kv_heads
    args = (
        q,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        split_size,
        window or 0,
        batch_bucket(num_seqs),
    )
    meta = dict(
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        SINGLE_SPLIT=num_splits == 1,
        HAS_WINDOW=window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=float(softcap or 0.0),
    )
    grid = (num_seqs, num_kv_heads, num_splits)
    if on_gpu:
        _paged_decode_kernel_tuned[grid](*args, **meta)
    else:
        _paged_decode_kernel[grid](*args, **meta, BLOCK_N=INTERPRETER_BLOCK_N)

    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            seq_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            split_size,
            window or 0,
            HAS_WINDOW=window is not None,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, in fp32: what `paged_decode_attention` computes."""
    page_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : math.ceil(seq_len / page_size)].long()
        keys = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if window is not None:
            scores[:, : max(seq_len - window, 0)] = float("-inf")
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(q.dtype)
    return out
