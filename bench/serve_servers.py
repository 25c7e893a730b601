"""Servers for bench/serve.py to measure: a gpu-worker (real, or bench/synthetic_worker.py)
and a render-serve in front of it, started and stopped as subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from subprocesses import free_port, stop, wait_http_ok, wait_ready_line

BENCH_DIR = Path(__file__).parent


@dataclass
class Launched:
    """Servers this script started: the render URL and both processes."""

    base_url: str
    render: subprocess.Popen
    worker: subprocess.Popen

    def processes(self) -> dict[str, psutil.Process]:
        return {
            "render-serve": psutil.Process(self.render.pid),
            "worker": psutil.Process(self.worker.pid),
            "load generator": psutil.Process(),
        }


@contextmanager
def launch(
    kind: str, *, worker_args: list[str], itl_ms: float = 10.0, torch_threads: int | None = None
) -> Iterator[Launched]:
    """Start a worker (`real` gpu-worker on CPU, or `synthetic`) and one render-serve
    connected to it; stop both on exit. Their stderr goes to a temporary log."""
    env = dict(os.environ)
    if torch_threads is not None:
        env["OMP_NUM_THREADS"] = str(torch_threads)  # torch's intra-op thread count
    logs = Path(tempfile.mkdtemp(prefix="duet-bench-"))
    address = f"tcp://127.0.0.1:{free_port()}"
    if kind == "real":
        command = [sys.executable, "-m", "gpu_worker.cli", "--bind", address, "--device", "cpu"]
        command += ["--kv-cache-memory-gb", "0.5", "--log-level", "warning", *worker_args]
    else:
        command = [sys.executable, str(BENCH_DIR / "synthetic_worker.py"), "--bind", address]
        command += ["--itl-ms", str(itl_ms), *worker_args]
    worker = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=(logs / "worker.log").open("w"),
        text=True,
        env=env,
    )
    render = None
    try:
        if not wait_ready_line(worker, "ready on", timeout_s=300):
            raise RuntimeError(f"the worker did not print 'ready on' (exit code {worker.poll()})")
        port = free_port()
        render = subprocess.Popen(
            [sys.executable, "-m", "render_server.cli", "--port", str(port)]
            + ["--worker", address, "--log-level", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=(logs / "render.log").open("w"),
        )
        base_url = f"http://127.0.0.1:{port}"
        if not wait_http_ok(f"{base_url}/ready", render, timeout_s=120, poll_s=0.2):
            raise RuntimeError(f"render-serve did not become ready; see {logs}")
        yield Launched(base_url, render, worker)
    finally:
        if render is not None:
            stop(render, timeout_s=15)
        stop(worker, timeout_s=15)


def served_model(base_url: str) -> str:
    response = httpx.get(f"{base_url}/v1/models", timeout=10)
    response.raise_for_status()
    return response.json()["data"][0]["id"]
