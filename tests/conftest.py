"""Fixtures shared across the test tree. Keep each one cheap to import; load lazily."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

from shared.model_source import DEFAULT_MODEL, ModelNotFoundError, ModelSource, resolve_model
from tests import running
from tests.helpers.redis import redis_server

if TYPE_CHECKING:
    from tests.helpers.processes import ServerProcess
    from tests.helpers.tiny_models import TinyModel

__all__ = ["redis_server"]  # a fixture: a real redis-server for the whole session

# Every Hypothesis example has a deadline, and each test's examples times it stay well inside
# pytest-timeout's 300 s: a slow or looping input fails by name. Counts are set per test.
EXAMPLE_DEADLINE = timedelta(seconds=2)
settings.register_profile(
    "duet", deadline=EXAMPLE_DEADLINE, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("duet")


def pytest_configure(config: pytest.Config) -> None:
    running.register(config)  # under tests.guard: which test runs, stacks on SIGUSR1


# Triton picks its CPU interpreter when `@triton.jit` decorates, so the flag must be set
# before any test module imports `kernels` (directly or through the triton backend).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    """The default model (SmolLM2-135M-Instruct GGUF), resolved once per session."""
    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source: ModelSource) -> Any:
    """duet's Tokenizer for the default model (render_server.templating.tokenizer.Tokenizer)."""
    from render_server.templating.tokenizer import Tokenizer

    return Tokenizer.from_source(smollm2_source)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny random Llama (untied embeddings, LlamaConfig's EOS 2, head_dim 16, GQA 2)
    with a word-level tokenizer of its vocabulary: an engine on it runs in milliseconds a
    step, on either attention backend, and fits the Triton interpreter. Shared by the
    session: a test that changes the model (PEFT injects its layers in place) builds its own."""
    from tests.helpers.tiny_models import save_tiny_model  # transformers: seconds to import

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer="words")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama: TinyModel) -> Path:
    """`tiny_llama`'s directory, for an `Engine` or a gpu-worker to serve."""
    return tiny_llama.path


@pytest.fixture(scope="session")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """render-serve (render only) with two API keys, CORS for one origin and a root_path
    (tests.helpers.processes.SECURE_ARGS), for the integration and e2e security tests."""
    from tests.helpers.processes import SECURE_ARGS, start_server, stop_server

    server = start_server(SECURE_ARGS, tmp_path_factory.mktemp("secure") / "render-serve.log")
    yield server
    stop_server(server)


# Fixtures too slow to build in the inner loop (`make test-fast`): a test that uses one is
# marked slow here, once, rather than by hand on each test.
SLOW_FIXTURES = {"hf_reference_tokenizer", "hf_reference_model"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def hf_reference_tokenizer(smollm2_source: ModelSource) -> Any:
    """transformers' tokenizer from the same GGUF: the reference for ids and chat templates.
    Slow to build: transformers reads the whole vocabulary through gguf.GGUFReader."""
    transformers = pytest.importorskip("transformers")
    # The GGUF loader logs a warning per call; it says nothing a test needs.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = smollm2_source.path
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_reference_model(smollm2_source: ModelSource) -> Any:
    """transformers' fp32 model from the same GGUF, read once per session (the read
    dequantizes every tensor: seconds). Shared: a test that changes it (PEFT injects its
    layers in place) works on a `copy.deepcopy`."""
    import torch

    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = smollm2_source.path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
