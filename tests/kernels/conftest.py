"""Kernel tests: Triton's CPU interpreter here, the real thing on a GPU.

Without CUDA, TRITON_INTERPRET=1 must be set before any `kernels` module is imported, because
`@triton.jit` chooses the interpreter when it decorates. pytest imports this conftest before the
test modules of this directory, so setting it here is early enough (as long as nothing imported
`kernels` earlier in the session). The interpreter computes bf16 wrongly, so bf16 runs on CUDA
only; on CPU the suite covers fp32 and fp16. The tests' other shared pieces (tolerances,
seeded tensors, `interpreter_only`) are in tests/helpers/kernel_checks.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_worker.attention.metadata import (  # noqa: E402
    AttentionMetadata,
    build_attention_metadata,
)
from tests.helpers.kernel_checks import ON_CUDA  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present, else the CPU (kernels then run in the interpreter)."""
    return torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """For `@pytest.mark.cuda` tests: full-size shapes that only make sense on a GPU."""
    if not ON_CUDA:
        pytest.skip("needs a CUDA device (full-size shapes; bf16 is wrong in the interpreter)")
    return torch.device("cuda")


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Every kernel test runs per dtype; bf16 only on CUDA."""
    if request.param == torch.bfloat16 and not ON_CUDA:
        pytest.skip("Triton's interpreter computes bf16 wrongly; bf16 is checked on CUDA")
    return request.param


PagedBatch = tuple[torch.Tensor, AttentionMetadata]


@pytest.fixture
def make_paged_batch(device: torch.device) -> Callable[..., PagedBatch]:
    """Builds a random KV cache and the metadata of one step over it.

    Blocks are handed out in a random order (so block tables are not contiguous), a few spare
    blocks hold garbage that must never be read, and the cache is filled for every position up
    to each seq_len (prefix and new tokens), ready for the kernels to read.
    """

    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int = 16,
        seed: int = 0,
    ) -> PagedBatch:
        gen = torch.Generator().manual_seed(seed)
        seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables, used = [], 0
        for n in blocks_per_seq:
            tables.append(order[used : used + n])
            used += n
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        kv_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device)
        return kv_cache, meta

    return build
