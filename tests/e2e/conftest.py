"""Real gpu-workers and render servers on loopback, shared by the whole e2e session.

Two workers (CPU, small KV caches) and three render servers: `render` uses worker A,
`render_b` shares worker A (two render servers on one worker), `render_pair` spreads over
both workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.integration.conftest import ServerProcess, free_port, stop_server

WORKER_STARTUP_S = 240
RENDER_STARTUP_S = 120


@dataclass
class WorkerProcess:
    """A running gpu-worker and its ZMQ address."""

    process: subprocess.Popen[str]
    address: str


def start_worker(log_path: Path, extra_args: list[str] | None = None) -> WorkerProcess:
    command = [
        sys.executable, "-m", "gpu_worker.cli", "--bind", "tcp://127.0.0.1:*",
        "--device", "cpu", "--kv-cache-memory-gb", "0.1", "--max-num-seqs", "64",
        "--heartbeat-interval", "0.2", "--log-level", "warning", *(extra_args or []),
    ]  # fmt: skip
    # One torch thread per worker: several processes share 2 cores in the suite, and
    # oversubscribed OpenMP threads slow every step by an order of magnitude.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log_path.open("wb"), text=True, env=env
    )
    assert process.stdout is not None
    deadline = time.monotonic() + WORKER_STARTUP_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith("gpu-worker ready on "):
            return WorkerProcess(process, line.split()[-1])
    process.kill()
    pytest.fail(f"gpu-worker did not start:\n{log_path.read_text(errors='replace')}")


def start_render(
    workers: list[str], log_path: Path, extra_args: list[str] | None = None
) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "render_server.cli", "--port", str(port), *(extra_args or [])]
    for address in workers:
        command += ["--worker", address]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DUET_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + RENDER_STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"render-serve exited:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/ready", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(server)
    pytest.fail(f"render-serve was not ready in {RENDER_STARTUP_S}s:\n{server.log()}")


def _stop_worker(worker: WorkerProcess) -> None:
    worker.process.terminate()
    try:
        worker.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        worker.process.kill()


@pytest.fixture(scope="session")
def worker_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = start_worker(tmp_path_factory.mktemp("worker-a") / "worker.log")
    yield worker
    _stop_worker(worker)


@pytest.fixture(scope="session")
def worker_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = start_worker(tmp_path_factory.mktemp("worker-b") / "worker.log")
    yield worker
    _stop_worker(worker)


@pytest.fixture(scope="session")
def render(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_render([worker_a.address], tmp_path_factory.mktemp("render") / "render.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def render_b(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_render([worker_a.address], tmp_path_factory.mktemp("render-b") / "render.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def render_pair(
    worker_a: WorkerProcess, worker_b: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("render-pair") / "render.log"
    server = start_render([worker_a.address, worker_b.address], path)
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def client(render: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{render.base_url}/v1", api_key="unused", max_retries=0)
