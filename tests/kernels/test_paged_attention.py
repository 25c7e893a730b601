"""Paged decode attention (split-K, GQA) against its torch reference and the torch backend."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels.cache_ops import write_kv_cache
from kernels.paged_attention import (
    choose_split_size,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tests.helpers.kernel_checks import ATTENTION_TOL, random_tensor

NUM_KV_HEADS = 2

# seq_lens, group (= num_heads // num_kv_heads), head_dim; block size 16.
DECODE_CASES = [
    pytest.param([1], 1, 64, id="one-token"),
    pytest.param([15, 16, 17], 3, 64, id="block-edges-gqa3"),
    pytest.param([33, 80, 1], 8, 128, id="gqa8-d128"),
    pytest.param([16, 33], 1, 128, id="mha-d128"),
]


def _decode_inputs(make_paged_batch, seq_lens, group, head_dim, dtype, device):
    query_lens = [1] * len(seq_lens)
    context_lens = [n - 1 for n in seq_lens]
    kv_cache, meta = make_paged_batch(query_lens, context_lens, NUM_KV_HEADS, head_dim, dtype)
    q = random_tensor(len(seq_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, device=device)
    return q, kv_cache, meta


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("seq_lens", "group", "head_dim"), DECODE_CASES)
def test_decode_matches_reference(make_paged_batch, device, dtype, seq_lens, group, head_dim):
    q, kv_cache, meta = _decode_inputs(make_paged_batch, seq_lens, group, head_dim, dtype, device)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale)
    expected = paged_decode_attention_ref(q, kv_cache, meta.block_tables, meta.seq_lens, scale)
    assert out.shape == q.shape
    assert out.dtype == dtype
    _assert_close(out, expected, dtype)


@pytest.mark.parametrize("split_size", [144, 64, 27, 16])
def test_decode_split_k(make_paged_batch, device, split_size):
    """One split, several, splits past a short sequence's end (they exit without writing and
    the combine must skip them), partitions ending mid-tile and mid-block."""
    dtype = torch.float32
    seq_lens = [1, 17, 80, 130]
    q, kv_cache, meta = _decode_inputs(make_paged_batch, seq_lens, 3, 64, dtype, device)
    args = (q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    out = paged_decode_attention(*args, split_size=split_size)
    _assert_close(out, paged_decode_attention_ref(*args), dtype)


def test_decode_matches_torch_backend(make_paged_batch, device, dtype):
    """The kernel path an engine step takes (write the new K/V, then attend) against
    TorchAttentionBackend.forward on the same cache and metadata."""
    seq_lens, group, head_dim = [1, 16, 17, 80], 3, 64
    q, kv_cache, meta = _decode_inputs(make_paged_batch, seq_lens, group, head_dim, dtype, device)
    k_new = random_tensor(len(seq_lens), NUM_KV_HEADS, head_dim, dtype=dtype, device=device, seed=2)
    v_new = random_tensor(len(seq_lens), NUM_KV_HEADS, head_dim, dtype=dtype, device=device, seed=3)
    ref_cache = kv_cache.clone()
    backend = TorchAttentionBackend()
    backend.plan(meta, ref_cache)
    expected = backend.forward(q, k_new, v_new, ref_cache, meta, 0.125)

    write_kv_cache(k_new, v_new, kv_cache, meta.slot_mapping)
    out = paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    assert torch.equal(kv_cache, ref_cache)
    _assert_close(out, expected, dtype)


def test_decode_strided_q_and_minus_one_padding(make_paged_batch, device):
    """q as a view into a fused QKV output, block tables padded with -1 and int64 lengths."""
    dtype, group, head_dim = torch.float16, 2, 64
    seq_lens = [47, 5]
    _, kv_cache, meta = _decode_inputs(make_paged_batch, seq_lens, group, head_dim, dtype, device)
    num_heads = NUM_KV_HEADS * group
    qkv = random_tensor(2, (num_heads + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(2, num_heads, head_dim)
    assert not q.is_contiguous()
    tables = meta.block_tables.clone()
    tables[1, 1:] = -1
    seq_lens_i64 = meta.seq_lens.long()
    out = paged_decode_attention(q, kv_cache, tables, seq_lens_i64, 0.125, split_size=32)
    expected = paged_decode_attention_ref(q, kv_cache, tables, seq_lens_i64, 0.125)
    _assert_close(out, expected, dtype)


def test_decode_rejects_bad_shapes(make_paged_batch, device):
    q, kv_cache, meta = _decode_inputs(make_paged_batch, [3], 1, 64, torch.float32, device)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :32], kv_cache, meta.block_tables, meta.seq_lens, 1.0)
    # A cache of another float dtype than q is read in q's (--kv-cache-dtype); fp64 is neither.
    with pytest.raises(ValueError, match="q must be fp16, bf16 or fp32"):
        paged_decode_attention(q.double(), kv_cache, meta.block_tables, meta.seq_lens, 1.0)
    with pytest.raises(ValueError, match="kv_cache must be fp16, bf16 or fp32"):
        paged_decode_attention(q, kv_cache.double(), meta.block_tables, meta.seq_lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(
            q[:, :1].expand(1, 3, 64), kv_cache, meta.block_tables, meta.seq_lens, 1.0
        )


def test_choose_split_size():
    # Few programs and a long context: splits as short as the programs wanted need.
    assert choose_split_size(1, 8, 32768, num_programs_target=528) == 512
    # Enough programs already: still at most 1024 tokens a split, so one long sequence
    # among many short ones is spread over 16 programs per KV head, not one.
    assert choose_split_size(64, 8, 16384, num_programs_target=528) == 1024
    # Never below 256 tokens, never more than 64 splits.
    assert choose_split_size(1, 8, 512, num_programs_target=528) == 256
    assert choose_split_size(1, 1, 1 << 20, num_programs_target=10_000) == 1 << 14
    # A short context is one split.
    assert choose_split_size(8, 8, 200, num_programs_target=528) == 256


@pytest.mark.cuda
def test_decode_full_size_bf16(cuda_device):
    """Llama-8B-like heads (32 q / 8 kv, D=128) in bf16 over contexts up to 4k, autotuned."""
    dtype, num_kv_heads, head_dim, num_seqs = torch.bfloat16, 8, 128, 12
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 4097, (num_seqs,), generator=gen).tolist()
    seq_lens[:3] = [1, 16, 4096]
    blocks = [-(-n // 16) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(num_seqs)]
    meta = build_attention_metadata(
        [1] * num_seqs, [n - 1 for n in seq_lens], tables, 16, cuda_device
    )
    kv_cache = torch.randn(2, sum(blocks), 16, num_kv_heads, head_dim, device=cuda_device)
    kv_cache = kv_cache.to(dtype)
    q = torch.randn(num_seqs, 32, head_dim, device=cuda_device, dtype=dtype)
    expected = paged_decode_attention_ref(q, kv_cache, meta.block_tables, meta.seq_lens, 0.088)
    for split_size in (None, 4096, 600):
        out = paged_decode_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens, 0.088, split_size=split_size
        )
        _assert_close(out, expected, dtype)


# seq_lens, window, group, split_size; block size 16, head_dim 64.
WINDOW_DECODE_CASES = [
    pytest.param([40, 5, 17], 8, 3, None, id="window-inside-one-block-gqa3"),
    pytest.param([40, 33, 16], 20, 2, None, id="window-spans-blocks"),
    pytest.param([130, 7, 64], 50, 1, 17, id="window-split-k"),
    pytest.param([3, 17], 1, 2, 1, id="window-one-key"),
]


@pytest.mark.parametrize(("seq_lens", "window", "group", "split_size"), WINDOW_DECODE_CASES)
def test_decode_sliding_window(
    make_paged_batch, device, dtype, seq_lens, window, group, split_size
):
    """Only the last `window` keys count; sequences shorter than the window see them all."""
    q, kv_cache, meta = _decode_inputs(make_paged_batch, seq_lens, group, 64, dtype, device)
    args = (q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    out = paged_decode_attention(*args, split_size=split_size, window=window)
    expected = paged_decode_attention_ref(*args, window=window)
    _assert_close(out, expected, dtype)
    # The window really cuts something (else the case would pass with no window at all).
    assert not torch.allclose(expected.float(), paged_decode_attention_ref(*args).float())


def test_decode_window_ignores_keys_outside(make_paged_batch, device):
    """Keys before the window are never read: NaN there leaves the output finite."""
    q, kv_cache, meta = _decode_inputs(make_paged_batch, [50], 2, 64, torch.float32, device)
    expected = paged_decode_attention_ref(q, kv_cache, meta.block_tables, meta.seq_lens, 0.1, 18)
    first_blocks = meta.block_tables[0, :2].long()  # keys 0..31, all before 50 - 18
    kv_cache[:, first_blocks] = float("nan")
    out = paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, 0.1, window=18)
    _assert_close(out, expected, torch.float32)


# window, split_size; softcap 1.5 at scale 0.5 saturates the tanh for most scores.
SOFTCAP_DECODE_CASES = [
    pytest.param(None, None, id="softcap"),
    pytest.param(None, 16, id="softcap-split-k"),
    pytest.param(20, 10, id="softcap-window"),
]


@pytest.mark.parametrize(("window", "split_size"), SOFTCAP_DECODE_CASES)
def test_decode_softcap(make_paged_batch, device, window, split_size):
    """Gemma 2's capped scores, alone and with a window, against the reference, and the
    torch backend's capped path on the same cache."""
    dtype = torch.float32
    seq_lens = [40, 5, 33]
    q, kv_cache, meta = _decode_inputs(make_paged_batch, seq_lens, 2, 64, dtype, device)
    args = (q, kv_cache, meta.block_tables, meta.seq_lens, 0.5)
    out = paged_decode_attention(*args, split_size=split_size, window=window, softcap=1.5)
    expected = paged_decode_attention_ref(*args, window=window, softcap=1.5)
    _assert_close(out, expected, dtype)
    # The cap really bites (else the case would pass without it).
    assert not torch.allclose(expected, paged_decode_attention_ref(*args, window=window))
    # Rewriting each sequence's last key with itself leaves the cache as it was.
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    k, v = flat[0, meta.slot_mapping].clone(), flat[1, meta.slot_mapping].clone()
    backend = TorchAttentionBackend()
    backend.plan(meta, kv_cache)
    torch_out = backend.forward(q, k, v, kv_cache, meta, 0.5, window, softcap=1.5)
    _assert_close(torch_out, expected, dtype)
