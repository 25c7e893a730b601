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
    start_server,
    start_worker,
    stop_server,
    stop_worker,
)

# Re-exported: e2e and unit test modules import the worker helpers from here.
__all__ = ["WorkerProcess", "running_render", "start_render", "start_worker"]


def start_render(
    workers: list[str], log_path: Path, extra_args: list[str] | None = None
) -> ServerProcess:
    """render-serve over `workers`, waited for until /ready (a worker connected) says 200."""
    args = [*(extra_args or []), *(arg for address in workers for arg in ("--worker", address))]
    return start_server(args, log_path, ready_path="/ready")


def _running_worker(directory: Path) -> Iterator[WorkerProcess]:
    """A fixture body: a worker logging under `directory`, drained at teardown."""
    worker = start_worker(directory / "worker.log")
    yield worker
    stop_worker(worker)


def running_render(
    workers: list[WorkerProcess], directory: Path, extra_args: list[str] | None = None
) -> Iterator[ServerProcess]:
    """A fixture body: render-serve over `workers`, logging under `directory`."""
    addresses = [worker.address for worker in workers]
    server = start_render(addresses, directory / "render.log", extra_args)
    yield server
    stop_server(server)


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
