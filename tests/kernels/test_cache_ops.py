"""write_kv_cache against its torch reference and TorchAttentionBackend.write_kv."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels.cache_ops import write_kv_cache, write_kv_cache_ref
from tests.helpers.kernel_checks import random_tensor


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(3, 64), (2, 80), (8, 128)])
def test_write_kv_cache_matches_reference(device, dtype, num_kv_heads, head_dim):
    """Slots across blocks, a negative (padding) slot that must be skipped, strided k/v."""
    num_tokens, block_size, num_blocks = 6, 16, 4
    slots = torch.tensor([0, 15, 16, 47, -1, 63], dtype=torch.int64, device=device)
    kv = random_tensor(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # views with a token stride of 2x
    cache = random_tensor(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, seed=5
    )
    expected = cache.clone()
    write_kv_cache_ref(k, v, expected, slots)
    write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_write_kv_cache_matches_torch_backend(device):
    k = random_tensor(5, 2, 64, dtype=torch.float16, device=device)
    v = random_tensor(5, 2, 64, dtype=torch.float16, device=device, seed=2)
    slots = torch.tensor([3, 17, 18, 40, 41], dtype=torch.int64, device=device)
    cache = torch.zeros(2, 3, 16, 2, 64, dtype=torch.float16, device=device)
    expected = cache.clone()
    TorchAttentionBackend().write_kv(k, v, expected, slots)
    write_kv_cache(k, v, cache, slots.int())
    assert torch.equal(cache, expected)


def test_write_kv_cache_rejects_mismatched_cache(device):
    k = torch.zeros(2, 2, 64, device=device)
    cache = torch.zeros(2, 3, 16, 4, 64, device=device)
    with pytest.raises(ValueError, match="does not match"):
        write_kv_cache(k, k, cache, torch.zeros(2, dtype=torch.int64, device=device))
