"""What the kernel tests share besides fixtures: the CUDA switch, tolerances per dtype, seeded
tensors and a stand-in that records a kernel's launches.

Imports no `kernels` module: tests/kernels/conftest.py must set TRITON_INTERPRET before the
first one is imported, and it imports this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

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


def random_tensor(
    *shape: int, dtype: torch.dtype, device: torch.device, seed: int = 1
) -> torch.Tensor:
    """Seeded normal values, drawn in fp32 on the CPU so every device sees the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


class KernelRecorder:
    """Stands in for a `@triton.jit` kernel (monkeypatched over it): records the grid and the
    positional arguments of each launch, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], tuple[Any, ...]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((grid, args))

        return launch
