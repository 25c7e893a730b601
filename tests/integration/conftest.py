"""Real `render-serve` processes on loopback, started once per test session.

`render_server` runs with no keys and trusts request chat templates (with a short render
deadline, for the hostile-template test); `secure_server` runs with two API keys, CORS for
one origin and a root_path, for the security tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

STARTUP_DEADLINE_S = 120.0
SECURE_KEYS = ("test-key-one", "test-key-two")
SECURE_ORIGIN = "http://allowed.test"
SECURE_ROOT_PATH = "/api"


@dataclass
class ServerProcess:
    """A running render-serve and how to reach it."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: list[str], log_path: Path) -> ServerProcess:
    """Start render-serve with `args` and wait (bounded) until /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "render_server.cli", "--port", str(port), *args]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DUET_")}
    # The log goes to a file, not a pipe: a chatty server cannot block on a full pipe.
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"render-serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(server)
    pytest.fail(f"render-serve did not answer /health in {STARTUP_DEADLINE_S}s:\n{server.log()}")


def stop_server(server: ServerProcess) -> None:
    """SIGTERM, then SIGKILL if it does not stop within its graceful-shutdown window."""
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def render_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """render-serve without keys, trusting request chat templates (1 s render deadline)."""
    log = tmp_path_factory.mktemp("render") / "render-serve.log"
    server = start_server(
        ["--render-only", "--trust-request-chat-template", "--render-deadline", "1.0"], log
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """render-serve with two API keys, CORS for SECURE_ORIGIN and root_path SECURE_ROOT_PATH."""
    log = tmp_path_factory.mktemp("secure") / "render-serve.log"
    args = [
        "--render-only",
        *[arg for key in SECURE_KEYS for arg in ("--api-key", key)],
        "--allowed-origins",
        SECURE_ORIGIN,
        "--root-path",
        SECURE_ROOT_PATH,
    ]
    server = start_server(args, log)
    yield server
    stop_server(server)


@pytest.fixture()
def client(render_server: ServerProcess) -> Iterator[httpx.Client]:
    """httpx client bound to the keyless server."""
    with httpx.Client(base_url=render_server.base_url, timeout=30.0) as http:
        yield http


@pytest.fixture()
def secure_client(secure_server: ServerProcess) -> Iterator[httpx.Client]:
    """httpx client bound to the keyed server, sending no key unless a test adds one."""
    with httpx.Client(base_url=secure_server.base_url, timeout=30.0) as http:
        yield http
