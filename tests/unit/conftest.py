"""Fixtures of the unit tests that use duet's CPU kernels."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from gpu_worker.ops.gguf_linear import load_extension


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    """The JIT-built CPU kernels; the test skips where they cannot be built."""
    module = load_extension()
    if module is None:
        pytest.skip("the duet CPU kernels cannot be built here")
    return module


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Two OpenMP threads on a shared 2-core box spin against other jobs."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
