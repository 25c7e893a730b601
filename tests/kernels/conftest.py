"""Kernel tests: Triton's CPU interpreter here, the real thing on a GPU.

Without CUDA, TRITON_INTERPRET=1 must be set before any `kernels` module is imported, because
`@triton.jit` chooses the interpreter when it decorates. pytest imports this conftest before the
test modules of this directory, so setting it here is early enough (as long as nothing imported
`kernels` earlier in the session). The interpreter computes bf16 wrongly, so bf16 runs on CUDA
only; on CPU the suite covers fp32 and fp16.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_worker.attention.metadata import (  # noqa: E402
    AttentionMetadata,
    build_attention_metadata,
)

ON_CUDA = torch.cuda.is_available()

interpreter_only = pytest.mark.skipif(
    ON_CUDA,
    reason="runs CPU tensors through Triton's interpreter; on a GPU the CUDA-tensor tests "
    "of the same kernels (and the engine on CUDA) cover it",
)
"""For a test whose subject is the CPU path itself (an engine on device="cpu" with the
Triton backend): on a CUDA host Triton compiles for the GPU and refuses CPU tensors."""

# (atol, rtol) per dtype. Attention is against an fp32 reference; fp16/bf16 lose precision
# where p is rounded for the second product and where the output is rounded.
ATTENTION_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
# Elementwise kernels round once more or less than torch at most: one or two ulps.
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


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


def random_tensor(*shape: int, dtype: torch.dtype, device: torch.device, seed: int = 1):
    """Seeded normal values, drawn in fp32 on the CPU so every device sees the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (head_dim 16, GQA 2) with a word-level tokenizer: enough for an
    `Engine` on either backend, small enough for the interpreter."""
    from tests.helpers.tiny_models import save_tiny_model, save_tiny_tokenizer

    out_dir, hf = save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "llama", tie_word_embeddings=False
    )
    save_tiny_tokenizer(out_dir, hf.config.vocab_size)
    return out_dir


class KernelRecorder:
    """Stands in for a `@triton.jit` kernel (monkeypatched over it): records the grid and the
    positional arguments of each launch, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], tuple[Any, ...]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((grid, args))

        return launch
