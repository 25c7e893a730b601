"""The Triton backend equals the torch backend on the same cache and metadata: on CUDA
tensors on a GPU, on CPU tensors through the interpreter elsewhere (the `device` fixture)."""

from __future__ import annotations

import torch

from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.runner.kv_caches import allocate_kv_caches


def test_mixed_batch_matches_the_torch_backend(device: torch.device) -> None:
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    # one prefill chunk over a cached prefix, one fresh prefill, two decodes
    query_lens, context_lens = [5, 17, 1, 1], [20, 0, 33, 7]
    tables = [[0, 1], [2, 3], [4, 5, 6], [7]]
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim).to(device)
    k = torch.randn(tokens, num_kv_heads, head_dim).to(device)
    v = torch.randn(tokens, num_kv_heads, head_dim).to(device)
    outputs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        torch.manual_seed(1)
        [cache] = allocate_kv_caches(
            1, 8, block_size, num_kv_heads, head_dim, torch.float32, device
        )
        cache.copy_(torch.randn(cache.shape))  # the cached prefixes, the same on any device
        backend.plan(meta, cache)
        outputs.append(backend.forward(q, k, v, cache, meta, head_dim**-0.5))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=2e-5)


def test_pure_decode_batch_matches_the_torch_backend(device: torch.device) -> None:
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, block_size = 8, 8, 64, 16
    context_lens, tables = [15, 16, 40], [[0], [1, 2], [3, 4, 5]]
    meta = build_attention_metadata([1, 1, 1], context_lens, tables, block_size, device)
    q = torch.randn(3, num_heads, head_dim).to(device)
    k = torch.randn(3, num_kv_heads, head_dim).to(device)
    v = torch.randn(3, num_kv_heads, head_dim).to(device)
    outputs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        torch.manual_seed(3)
        [cache] = allocate_kv_caches(
            1, 6, block_size, num_kv_heads, head_dim, torch.float32, device
        )
        cache.copy_(torch.randn(cache.shape))
        backend.plan(meta, cache)
        outputs.append(backend.forward(q, k, v, cache, meta, head_dim**-0.5))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=2e-5)


def test_sliding_window_matches_the_reference(device: torch.device) -> None:
    """Both backends with a window shorter than the sequences, on a mixed step (prefix
    chunk, fresh prefill, decodes) and a pure-decode step, against the kernels' torch
    reference; each step also runs windowless in between, as layers of a model may."""
    from kernels.prefill_attention import paged_prefill_attention_ref

    torch.manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size, window = 4, 2, 32, 16, 11
    tables = [[0, 1], [2, 3], [4, 5, 6], [7]]
    for query_lens, context_lens in (([5, 17, 1, 1], [20, 0, 33, 7]), ([1] * 4, [20, 30, 40, 9])):
        meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device)
        tokens = sum(query_lens)
        q = torch.randn(tokens, num_heads, head_dim).to(device)
        k = torch.randn(tokens, num_kv_heads, head_dim).to(device)
        v = torch.randn(tokens, num_kv_heads, head_dim).to(device)
        shape = (1, 8, block_size, num_kv_heads, head_dim)
        [cache] = allocate_kv_caches(*shape, torch.float32, device)
        cache.copy_(torch.randn(cache.shape))
        args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.context_lens, 0.2)
        for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
            backend.plan(meta, cache)
            for win in (window, None, window):
                out = backend.forward(q, k, v, cache, meta, 0.2, win)
                expected = paged_prefill_attention_ref(q, cache, *args, window=win)
                torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
