"""Fixtures shared by unit tests: duet's CPU kernels, one thread, and engines on the tiny
random Llama (tests/conftest.py's `tiny_llama_dir`) with and without speculation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.ops.gguf_linear import load_extension
from tests.helpers.spec_engines import METHODS, spec_engine


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


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> Engine:
    """The tiny Llama decoding without speculation."""
    return spec_engine(tiny_llama_dir, None)


@pytest.fixture(scope="module", params=sorted(METHODS))
def spec(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Engine:
    """The tiny Llama speculating by each method in turn (tests/helpers/spec_engines.METHODS)."""
    return spec_engine(tiny_llama_dir, METHODS[request.param])
