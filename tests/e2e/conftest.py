"""Real gpu-workers and render servers on loopback, shared by the whole e2e session.

Two workers (CPU, small KV caches) and three render servers: `render` uses worker A,
`render_b` shares worker A (two render servers on one worker), `render_pair` spreads over
both workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    running_render,
    start_worker,
    stop_worker,
)


def _running_worker(directory: Path) -> Iterator[WorkerProcess]:
    """A fixture body: a worker logging under `directory`, drained at teardown."""
    worker = start_worker(directory / "worker.log")
    yield worker
    stop_worker(worker)


@pytest.fixture(scope="session")
def worker_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    yield from _running_worker(tmp_path_factory.mktemp("worker-a"))


@pytest.fixture(scope="session")
def worker_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    yield from _running_worker(tmp_path_factory.mktemp("worker-b"))


@pytest.fixture(scope="session")
def render(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_render([worker_a], tmp_path_factory.mktemp("render"))


@pytest.fixture(scope="session")
def render_b(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_render([worker_a], tmp_path_factory.mktemp("render-b"))


@pytest.fixture(scope="session")
def render_pair(
    worker_a: WorkerProcess, worker_b: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_render([worker_a, worker_b], tmp_path_factory.mktemp("render-pair"))


@pytest.fixture(scope="session")
def client(render: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{render.base_url}/v1", api_key="unused", max_retries=0)
