"""Fixtures shared by unit tests: duet's CPU kernels, one thread, a tiny random Llama, and
engines on it with and without speculation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.ops.gguf_linear import load_extension
from tests.helpers.spec_engines import METHODS, spec_engine
from tests.helpers.tiny_models import save_tiny_model, save_tiny_tokenizer


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (untied embeddings, LlamaConfig's EOS 2) with a word-level
    tokenizer of its vocabulary: an engine on it runs in milliseconds a step."""
    out_dir, hf = save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "llama", tie_word_embeddings=False
    )
    save_tiny_tokenizer(out_dir, hf.config.vocab_size)
    return out_dir


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> Engine:
    """The tiny Llama decoding without speculation."""
    return spec_engine(tiny_llama_dir, None)


@pytest.fixture(scope="module", params=sorted(METHODS))
def spec(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Engine:
    """The tiny Llama speculating by each method in turn (tests/helpers/spec_engines.METHODS)."""
    return spec_engine(tiny_llama_dir, METHODS[request.param])
