"""A KV cache of another dtype than the queries' (--kv-cache-dtype) in the Triton kernels:
the write rounds k/v to the cache's dtype, the decode and prefill kernels read it back in
the queries' dtype. Each is checked against the torch reference over the same stored
values (which read them in fp32), and the Triton backend against the torch backend.

Under the interpreter bf16 arithmetic is wrong (see conftest) and fp32 -> bf16 truncates
(Triton on a GPU rounds to nearest even, as torch does): bf16 queries and bf16 writes run on
CUDA only. Reading a bf16 cache into fp32 queries is exact and runs everywhere.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from kernels.cache_ops import write_kv_cache, write_kv_cache_ref
from kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.helpers.kernel_checks import ATTENTION_TOL, ON_CUDA, random_tensor

NUM_KV_HEADS = 2

# (query dtype, cache dtype): the cache narrower than the queries, and wider.
PAIRS = [
    pytest.param(torch.float32, torch.float16, id="q-fp32-cache-fp16"),
    pytest.param(torch.float32, torch.bfloat16, id="q-fp32-cache-bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="q-bf16-cache-fp32"),
    pytest.param(torch.float16, torch.float32, id="q-fp16-cache-fp32"),
]


def _skip_bf16_in_interpreter(q_dtype: torch.dtype, written: torch.dtype | None = None) -> None:
    """Skip under the interpreter when bf16 is computed in (the queries) or rounded to
    (`written`: the cache a kernel stores into)."""
    if torch.bfloat16 in (q_dtype, written) and not ON_CUDA:
        pytest.skip("Triton's interpreter computes and rounds bf16 wrongly; checked on CUDA")


def _cache(make_paged_batch, query_lens, context_lens, head_dim, cache_dtype):
    return make_paged_batch(query_lens, context_lens, NUM_KV_HEADS, head_dim, cache_dtype)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), PAIRS)
def test_write_rounds_to_the_cache_dtype(device, q_dtype, cache_dtype):
    """What is stored is k/v converted by torch's `.to(cache dtype)`, bit for bit."""
    _skip_bf16_in_interpreter(q_dtype, written=cache_dtype)
    slots = torch.tensor([0, 15, 16, 47, -1, 63], dtype=torch.int64, device=device)
    kv = random_tensor(6, 2 * NUM_KV_HEADS, 64, dtype=q_dtype, device=device) * 3
    k, v = kv[:, :NUM_KV_HEADS], kv[:, NUM_KV_HEADS:]
    cache = torch.zeros(2, 4, 16, NUM_KV_HEADS, 64, dtype=cache_dtype, device=device)
    expected = cache.clone()
    write_kv_cache_ref(k, v, expected, slots)
    write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)
    torch_cache = torch.zeros_like(cache)
    keep = slots >= 0
    TorchAttentionBackend().write_kv(k[keep], v[keep], torch_cache, slots[keep])
    assert torch.equal(torch_cache, expected)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), PAIRS)
@pytest.mark.parametrize("split_size", [None, 32])
def test_decode_reads_the_cache_in_the_query_dtype(
    make_paged_batch, device, q_dtype, cache_dtype, split_size
):
    _skip_bf16_in_interpreter(q_dtype)
    seq_lens, group, head_dim = [1, 17, 80], 3, 64
    kv_cache, meta = _cache(
        make_paged_batch, [1] * 3, [n - 1 for n in seq_lens], head_dim, cache_dtype
    )
    q = random_tensor(3, NUM_KV_HEADS * group, head_dim, dtype=q_dtype, device=device)
    args = (q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    out = paged_decode_attention(*args, split_size=split_size)
    assert out.dtype == q_dtype
    atol, rtol = ATTENTION_TOL[q_dtype]
    torch.testing.assert_close(
        out.float(), paged_decode_attention_ref(*args).float(), atol=atol, rtol=rtol
    )


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), PAIRS)
def test_prefill_reads_the_cache_in_the_query_dtype(make_paged_batch, device, q_dtype, cache_dtype):
    _skip_bf16_in_interpreter(q_dtype)
    query_lens, context_lens, group, head_dim = [1, 17, 5], [15, 0, 40], 2, 64
    kv_cache, meta = _cache(make_paged_batch, query_lens, context_lens, head_dim, cache_dtype)
    q = random_tensor(sum(query_lens), NUM_KV_HEADS * group, head_dim, dtype=q_dtype, device=device)
    args = (q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.context_lens)
    out = paged_prefill_attention(*args, meta.max_query_len, 0.125)
    assert out.dtype == q_dtype
    atol, rtol = ATTENTION_TOL[q_dtype]
    expected = paged_prefill_attention_ref(*args, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([5, 17, 1, 1], [20, 0, 33, 7]), ([1, 1, 1, 1], [20, 30, 40, 9])],
    ids=["mixed", "decode"],
)
def test_triton_backend_matches_the_torch_backend(device, cache_dtype, query_lens, context_lens):
    """fp32 queries over a 16-bit cache: both backends store the same rounded k/v and
    attend over the same values (the torch backend's fresh prefill too)."""
    _skip_bf16_in_interpreter(torch.float32, written=cache_dtype)
    torch.manual_seed(0)
    num_heads, head_dim, block_size = 6, 64, 16
    tables = [[0, 1], [2, 3], [4, 5, 6], [7]]
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim).to(device)
    k = torch.randn(tokens, NUM_KV_HEADS, head_dim).to(device)
    v = torch.randn(tokens, NUM_KV_HEADS, head_dim).to(device)
    prefix = torch.randn(2, 8, block_size, NUM_KV_HEADS, head_dim).to(cache_dtype).to(device)
    caches, outputs = [], []
    for backend in (TorchAttentionBackend(torch.float32), TritonAttentionBackend()):
        cache = prefix.clone()
        backend.plan(meta, cache)
        outputs.append(backend.forward(q, k, v, cache, meta, head_dim**-0.5))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=2e-5)
