"""Start and stop real `gpu-worker` and `render-serve` processes for integration and e2e tests.

One place for what every such test needs: a free loopback port, a render server started
with a clean environment and waited for (bounded) on a readiness route, a CPU worker
started with one torch thread and waited for (bounded) on its "gpu-worker ready on ADDRESS"
stdout line, and teardown that escalates to SIGKILL instead of hanging. A process that does
not come up fails the test with its log, so a startup problem reads as one.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

import httpx
import pytest

from tests.helpers.waiting import WaitTimeout, wait_until

SERVER_STARTUP_S = 120.0
WORKER_STARTUP_S = 240.0
WORKER_READY_PREFIX = "gpu-worker ready on "
# The e2e suite's worker: small enough that several share a 2-core machine, and a fast
# heartbeat so that fault tests notice a dead worker within seconds.
DEFAULT_KV_CACHE_GB = 0.1
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_HEARTBEAT_INTERVAL_S = 0.2


class WorkerOptions(TypedDict, total=False):
    """Keyword options of `spawn_worker` and `start_worker`, to name a preset once."""

    kv_cache_gb: float
    max_num_seqs: int | None
    heartbeat_interval_s: float | None


# The integration tests' worker: one client at a time, so the smallest KV cache and the
# worker's own defaults for the rest (heartbeat timing included, which they observe).
SMALL_WORKER: WorkerOptions = {
    "kv_cache_gb": 0.05,
    "max_num_seqs": None,
    "heartbeat_interval_s": None,
}


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def spawn_server(
    args: list[str], log_path: Path, env: Mapping[str, str] | None = None
) -> ServerProcess:
    """Start render-serve with `args` on a free port without waiting for it. `env` adds
    variables on top of the test's environment less DUET_*."""
    port = free_port()
    command = [sys.executable, "-m", "render_server.cli", "--port", str(port), *args]
    # DUET_* settings of whoever runs the tests must not change what the server is told.
    clean = {key: value for key, value in os.environ.items() if not key.startswith("DUET_")}
    # The log goes to a file, not a pipe: a chatty server cannot block on a full pipe.
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**clean, **(env or {})}
        )
    return ServerProcess(process, port, log_path)


def start_server(
    args: list[str],
    log_path: Path,
    *,
    ready_path: str = "/health",
    env: Mapping[str, str] | None = None,
    startup_s: float = SERVER_STARTUP_S,
) -> ServerProcess:
    """`spawn_server`, then wait (bounded) until `ready_path` answers 200."""
    server = spawn_server(args, log_path, env)
    process = server.process

    def answers() -> bool:
        # Checked on every poll: an early exit fails at once, not at the deadline.
        if process.poll() is not None:
            pytest.fail(f"render-serve exited with {process.returncode}:\n{server.log()}")
        return httpx.get(f"{server.base_url}{ready_path}", timeout=1.0).status_code == 200

    try:
        wait_until(
            answers,
            startup_s,
            f"render-serve to answer {ready_path}",
            interval_s=0.1,
            ignoring=(httpx.TransportError,),
        )
    except WaitTimeout:
        stop_server(server)
        pytest.fail(f"render-serve did not answer {ready_path} in {startup_s}s:\n{server.log()}")
    return server


def stop_server(server: ServerProcess) -> None:
    """SIGTERM, then SIGKILL if it does not stop within its graceful-shutdown window."""
    _terminate(server.process, 15.0)


SECURE_KEYS = ("test-key-one", "test-key-two")
SECURE_ORIGIN = "http://allowed.test"
SECURE_ROOT_PATH = "/api"
SECURE_ARGS = [
    "--render-only",
    *[arg for key in SECURE_KEYS for arg in ("--api-key", key)],
    "--allowed-origins",
    SECURE_ORIGIN,
    "--root-path",
    SECURE_ROOT_PATH,
]
"""The keyed render-serve's flags (the `secure_server` fixture): two API keys, CORS for one
origin and a root_path."""


@dataclass
class WorkerProcess:
    """A running gpu-worker and its ZMQ address."""

    process: subprocess.Popen[bytes]
    address: str
    log_path: Path | None = None


def spawn_worker(
    log_path: Path | None,
    extra_args: list[str] | None = None,
    *,
    kv_cache_gb: float = DEFAULT_KV_CACHE_GB,
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS,
    heartbeat_interval_s: float | None = DEFAULT_HEARTBEAT_INTERVAL_S,
) -> subprocess.Popen[bytes]:
    """Start a CPU gpu-worker on a random loopback port without waiting for it.

    stderr goes to `log_path`, or to the test's own stderr when it is None. `max_num_seqs`
    and `heartbeat_interval_s` of None leave the worker's defaults. Use `wait_worker_ready`
    (or `start_worker`, which does both) before talking to it.
    """
    command = [
        sys.executable, "-m", "gpu_worker.cli", "--bind", "tcp://127.0.0.1:*",
        "--device", "cpu", "--kv-cache-memory-gb", str(kv_cache_gb), "--log-level", "warning",
    ]  # fmt: skip
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    if heartbeat_interval_s is not None:
        command += ["--heartbeat-interval", str(heartbeat_interval_s)]
    command += extra_args or []
    # One torch thread per worker: several processes share 2 cores in the suite, and
    # oversubscribed OpenMP threads slow every step by an order of magnitude.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as files:
        stderr = None if log_path is None else files.enter_context(log_path.open("wb"))
        # Unbuffered stdout: `_ready_address` selects on the descriptor, and a buffered
        # reader could hold the ready line where select does not see it.
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, bufsize=0, env=env)


def _ready_address(process: subprocess.Popen[bytes], deadline: float) -> str | None:
    """The address from the worker's ready line, or None on exit or at `deadline`.

    select() before each read bounds the wait even when the worker hangs silently, which a
    bare readline would not.
    """
    assert process.stdout is not None
    descriptor = process.stdout.fileno()
    pending = b""
    while (remaining := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([descriptor], [], [], remaining)
        if not readable:
            return None
        chunk = os.read(descriptor, 4096)
        if not chunk:
            return None  # stdout closed: the worker exited
        pending += chunk
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            text = line.decode(errors="replace")
            if text.startswith(WORKER_READY_PREFIX):
                return text.split()[-1]
    return None


def wait_worker_ready(
    process: subprocess.Popen[bytes], log_path: Path | None, deadline: float
) -> WorkerProcess:
    """Wait (until the monotonic `deadline`) for a spawned worker's ready line; on exit or
    timeout kill it and fail the test with its log."""
    address = _ready_address(process, deadline)
    if address is not None:
        return WorkerProcess(process, address, log_path)
    process.kill()
    process.wait()
    log = "(stderr not logged)" if log_path is None else log_path.read_text(errors="replace")
    pytest.fail(f"gpu-worker did not start (exit code {process.returncode}):\n{log}")


def start_worker(
    log_path: Path | None,
    extra_args: list[str] | None = None,
    *,
    startup_s: float = WORKER_STARTUP_S,
    **options: Unpack[WorkerOptions],
) -> WorkerProcess:
    """Start a CPU gpu-worker (see `spawn_worker` for the options) and wait until it is
    ready, at most `startup_s`."""
    process = spawn_worker(log_path, extra_args, **options)
    return wait_worker_ready(process, log_path, time.monotonic() + startup_s)


def stop_worker(worker: WorkerProcess, timeout_s: float = 15.0) -> int:
    """SIGTERM (after SIGCONT, in case a test stopped it), SIGKILL after `timeout_s`;
    returns the exit code."""
    if worker.process.poll() is None:
        # A stopped process does not act on SIGTERM until it is continued.
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.process.pid, signal.SIGCONT)
    return _terminate(worker.process, timeout_s)


def kill_worker(worker: WorkerProcess) -> None:
    """SIGKILL, as a crash would (works on a stopped process too), and reap it."""
    if worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait(10)


def start_render(
    workers: list[str], log_path: Path, extra_args: list[str] | None = None
) -> ServerProcess:
    """render-serve over `workers`, waited for until /ready (a worker connected) says 200."""
    args = [*(extra_args or []), *(arg for address in workers for arg in ("--worker", address))]
    return start_server(args, log_path, ready_path="/ready")


def running_render(
    workers: list[WorkerProcess], directory: Path, extra_args: list[str] | None = None
) -> Iterator[ServerProcess]:
    """A fixture body: render-serve over `workers`, logging under `directory`, stopped at
    teardown."""
    addresses = [worker.address for worker in workers]
    server = start_render(addresses, directory / "render.log", extra_args)
    yield server
    stop_server(server)


def _terminate(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if the process is still there after `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
