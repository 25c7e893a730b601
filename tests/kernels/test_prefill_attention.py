"""Varlen prefill over a paged prefix (causal, GQA, mixed batches) against its torch
reference and the torch backend."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.metadata import AttentionMetadata, build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels.cache_ops import write_kv_cache
from kernels.prefill_attention import (
    choose_block_m,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.helpers.kernel_checks import ATTENTION_TOL, random_tensor

NUM_KV_HEADS = 2

# query_lens, context_lens, group (= num_heads // num_kv_heads), head_dim; block size 16.
PREFILL_CASES = [
    pytest.param([1], [0], 1, 64, id="one-token"),
    pytest.param([15, 16, 17], [0, 0, 0], 3, 64, id="block-edges-empty-prefix-gqa3"),
    pytest.param([33, 5], [80, 16], 8, 128, id="long-prefix-gqa8-d128"),
    pytest.param([1, 17, 1, 4], [15, 0, 80, 33], 3, 128, id="mixed-with-decodes"),
    pytest.param([130], [0], 1, 64, id="mha-two-tiles"),
]


def _prefill_inputs(make_paged_batch, query_lens, context_lens, group, head_dim, dtype, device):
    kv_cache, meta = make_paged_batch(query_lens, context_lens, NUM_KV_HEADS, head_dim, dtype)
    num_heads = NUM_KV_HEADS * group
    q = random_tensor(sum(query_lens), num_heads, head_dim, dtype=dtype, device=device)
    return q, kv_cache, meta


def _run(q, kv_cache, meta: AttentionMetadata, scale, max_query_len=None):
    max_query_len = meta.max_query_len if max_query_len is None else max_query_len
    return paged_prefill_attention(
        q,
        kv_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.context_lens,
        max_query_len,
        scale,
    )


def _ref(q, kv_cache, meta: AttentionMetadata, scale):
    return paged_prefill_attention_ref(
        q,
        kv_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.context_lens,
        scale,
    )


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("query_lens", "context_lens", "group", "head_dim"), PREFILL_CASES)
def test_prefill_matches_reference(
    make_paged_batch, device, dtype, query_lens, context_lens, group, head_dim
):
    q, kv_cache, meta = _prefill_inputs(
        make_paged_batch, query_lens, context_lens, group, head_dim, dtype, device
    )
    out = _run(q, kv_cache, meta, head_dim**-0.5)
    assert out.shape == q.shape
    assert out.dtype == dtype
    _assert_close(out, _ref(q, kv_cache, meta, head_dim**-0.5), dtype)


def test_prefill_matches_torch_backend(make_paged_batch, device, dtype):
    """A mixed step (prefill chunks with and without a prefix, decodes) through write_kv_cache
    and the kernel, against TorchAttentionBackend.forward on the same cache and metadata."""
    query_lens, context_lens, group, head_dim = [17, 1, 33, 1], [0, 15, 47, 16], 3, 64
    q, kv_cache, meta = _prefill_inputs(
        make_paged_batch, query_lens, context_lens, group, head_dim, dtype, device
    )
    num_tokens = sum(query_lens)
    k_new = random_tensor(num_tokens, NUM_KV_HEADS, head_dim, dtype=dtype, device=device, seed=2)
    v_new = random_tensor(num_tokens, NUM_KV_HEADS, head_dim, dtype=dtype, device=device, seed=3)
    ref_cache = kv_cache.clone()
    backend = TorchAttentionBackend()
    backend.plan(meta, ref_cache)
    expected = backend.forward(q, k_new, v_new, ref_cache, meta, 0.125)

    write_kv_cache(k_new, v_new, kv_cache, meta.slot_mapping)
    out = _run(q, kv_cache, meta, 0.125)
    assert torch.equal(kv_cache, ref_cache)
    _assert_close(out, expected, dtype)


def test_prefill_tile_size_hint_does_not_change_results(make_paged_batch, device):
    """max_query_len only picks the tile; a too-small hint must still cover every token."""
    dtype = torch.float32
    q, kv_cache, meta = _prefill_inputs(make_paged_batch, [20, 3], [5, 0], 3, 64, dtype, device)
    expected = _ref(q, kv_cache, meta, 0.125)
    _assert_close(_run(q, kv_cache, meta, 0.125, max_query_len=1), expected, dtype)


def test_prefill_strided_q(make_paged_batch, device):
    """q as a view into a fused QKV output, as the model produces it."""
    dtype, group, head_dim, query_lens = torch.float16, 2, 64, [9, 20]
    _, kv_cache, meta = _prefill_inputs(
        make_paged_batch, query_lens, [7, 0], group, head_dim, dtype, device
    )
    num_heads, num_tokens = NUM_KV_HEADS * group, sum(query_lens)
    width = (num_heads + 2 * NUM_KV_HEADS) * head_dim
    qkv = random_tensor(num_tokens, width, dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    _assert_close(_run(q, kv_cache, meta, 0.125), _ref(q, kv_cache, meta, 0.125), dtype)


def test_choose_block_m():
    assert choose_block_m(1, 1) == 16  # decodes, no GQA: the smallest tl.dot tile
    assert choose_block_m(1, 8) == 16
    assert choose_block_m(3, 4) == 16
    assert choose_block_m(2048, 4) == 128
    assert choose_block_m(1, 32) == 32  # the whole group of one token fits a tile


@pytest.mark.cuda
def test_prefill_full_size_bf16(cuda_device):
    """Llama-8B-like heads (32 q / 8 kv, D=128) in bf16: a long prefill with a prefix, a fresh
    prefill and decodes in one batch, autotuned."""
    dtype, num_kv_heads, head_dim = torch.bfloat16, 8, 128
    query_lens, context_lens = [700, 1, 1000, 1, 37], [1200, 3000, 0, 17, 64]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks = [-(-n // 16) for n in seq_lens]
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    meta = build_attention_metadata(query_lens, context_lens, tables, 16, cuda_device)
    kv_cache = torch.randn(2, sum(blocks), 16, num_kv_heads, head_dim, device=cuda_device)
    kv_cache = kv_cache.to(dtype)
    q = torch.randn(sum(query_lens), 32, head_dim, device=cuda_device, dtype=dtype)
    _assert_close(_run(q, kv_cache, meta, 0.088), _ref(q, kv_cache, meta, 0.088), dtype)


# query_lens, context_lens, window, group; block size 16, head_dim 64.
WINDOW_PREFILL_CASES = [
    pytest.param([40], [0], 8, 1, id="fresh-window-8"),
    pytest.param([20, 1, 33], [30, 50, 16], 13, 3, id="mixed-prefix-decode-gqa3"),
    pytest.param([70], [5], 40, 2, id="window-longer-than-a-key-tile"),
    pytest.param([9, 3], [0, 20], 1, 2, id="window-one-key"),
]


@pytest.mark.parametrize(("query_lens", "context_lens", "window", "group"), WINDOW_PREFILL_CASES)
def test_prefill_sliding_window(
    make_paged_batch, device, dtype, query_lens, context_lens, window, group
):
    q, kv_cache, meta = _prefill_inputs(
        make_paged_batch, query_lens, context_lens, group, 64, dtype, device
    )
    args = (q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    out = paged_prefill_attention(
        *args, meta.context_lens, meta.max_query_len, 0.125, window=window
    )
    expected = paged_prefill_attention_ref(*args, meta.context_lens, 0.125, window)
    _assert_close(out, expected, dtype)
    assert not torch.allclose(expected.float(), _ref(q, kv_cache, meta, 0.125).float())


def test_prefill_window_small_tiles(make_paged_batch, device):
    """A too-small tile hint (one token per tile) with a window: rows of one tile start
    their windows at different keys."""
    dtype = torch.float32
    q, kv_cache, meta = _prefill_inputs(make_paged_batch, [25, 4], [10, 40], 2, 64, dtype, device)
    args = (q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.context_lens)
    out = paged_prefill_attention(*args, 1, 0.125, window=6)
    _assert_close(out, paged_prefill_attention_ref(*args, 0.125, 6), dtype)


def test_prefill_window_ignores_keys_outside(make_paged_batch, device):
    """Key tiles wholly before a tile's first window are never read: NaN there leaves the
    output finite (a chunk of 4 at position 300, window 8: keys 0..255 lie before the
    window's key tile for every BLOCK_N up to 128)."""
    dtype = torch.float32
    q, kv_cache, meta = _prefill_inputs(make_paged_batch, [4], [300], 2, 64, dtype, device)
    args = (q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.context_lens)
    expected = paged_prefill_attention_ref(*args, 0.125, 8)
    kv_cache[:, meta.block_tables[0, :16].long()] = float("nan")
    _assert_close(paged_prefill_attention(*args, 4, 0.125, window=8), expected, dtype)


# query_lens, context_lens, window; softcap 1.5 at scale 0.5 saturates most scores.
SOFTCAP_PREFILL_CASES = [
    pytest.param([20, 1, 9], [0, 30, 16], None, id="softcap"),
    pytest.param([20, 1, 9], [0, 30, 16], 13, id="softcap-window"),
]


@pytest.mark.parametrize(("query_lens", "context_lens", "window"), SOFTCAP_PREFILL_CASES)
def test_prefill_softcap(make_paged_batch, device, query_lens, context_lens, window):
    """Capped scores with and without a window, against the reference and against the
    torch backend's capped path (rewriting the step's own keys leaves the cache as it was)."""
    dtype = torch.float32
    q, kv_cache, meta = _prefill_inputs(
        make_paged_batch, query_lens, context_lens, 2, 64, dtype, device
    )
    args = (q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    out = paged_prefill_attention(
        *args, meta.context_lens, meta.max_query_len, 0.5, window=window, softcap=1.5
    )
    expected = paged_prefill_attention_ref(*args, meta.context_lens, 0.5, window, softcap=1.5)
    _assert_close(out, expected, dtype)
    uncapped = paged_prefill_attention_ref(*args, meta.context_lens, 0.5, window)
    assert not torch.allclose(expected, uncapped)
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    k, v = flat[0, meta.slot_mapping].clone(), flat[1, meta.slot_mapping].clone()
    backend = TorchAttentionBackend()
    backend.plan(meta, kv_cache)
    torch_out = backend.forward(q, k, v, kv_cache, meta, 0.5, window, softcap=1.5)
    _assert_close(torch_out, expected, dtype)
