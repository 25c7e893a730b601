"""The servers the serving benchmarks measure, started and stopped as subprocesses: a CPU
gpu-worker (or bench/serving/synthetic_worker.py, with no model) and a render-serve in front
of it, and a bare wire client that reads a worker's heartbeats."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import zmq

from bench.common.results_md import BENCH_DIR
from bench.common.subprocesses import free_port, stop, wait_http_ok, wait_ready_line
from shared.protocol import Encoder, Heartbeat, Hello, WorkerMessageDecoder, WorkerStats
from shared.transport import make_dealer

REPO = BENCH_DIR.parent


def start_worker(
    log: Path, args: list[str], threads: int | None = None, *, synthetic: bool = False
) -> tuple[subprocess.Popen, str]:
    """A CPU gpu-worker (or the synthetic one) on a free loopback port, with `threads`
    torch threads; returns it and its address once it says it is ready."""
    address = f"tcp://127.0.0.1:{free_port()}"
    if synthetic:
        command = [sys.executable, "-m", "bench.serving.synthetic_worker", "--bind", address]
    else:
        command = [sys.executable, "-m", "gpu_worker.cli", "--bind", address, "--device", "cpu"]
        command += ["--log-level", "warning"]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op thread count
    stderr = log.open("w")
    process = subprocess.Popen(
        [*command, *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO
    )
    if wait_ready_line(process, "ready on", timeout_s=300):
        assert process.stdout is not None
        process.stdout.close()  # nothing else is read; never let a pipe fill
        return process, address
    stop(process)
    raise RuntimeError(f"the worker did not start (exit code {process.poll()}); see {log}")


def start_render(log: Path, workers: list[str], args: list[str]) -> tuple[subprocess.Popen, str]:
    """render-serve on a free port, connected to `workers`; returns it and its URL once
    /ready. DUET_* settings of this environment stay out of it: its flags are the run's."""
    port = free_port()
    command = [sys.executable, "-m", "render_server.cli", "--port", str(port)]
    command += ["--log-level", "warning", *args]
    for address in workers:
        command += ["--worker", address]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DUET_")}
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO
    )
    base_url = f"http://127.0.0.1:{port}"
    if wait_http_ok(f"{base_url}/ready", process, timeout_s=180, poll_s=0.2):
        return process, base_url
    stop(process)
    raise RuntimeError(f"render-serve did not become ready; see {log}")


@dataclass
class Launched:
    """Servers `launch` started: the render URL and both processes."""

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
    connected to it; stop both on exit. Their logs go to a temporary folder."""
    logs = Path(tempfile.mkdtemp(prefix="duet-bench-"))
    if kind == "real":
        args = ["--kv-cache-memory-gb", "0.5", *worker_args]
    else:
        args = ["--itl-ms", str(itl_ms), *worker_args]
    worker, address = start_worker(
        logs / "worker.log", args, torch_threads, synthetic=kind != "real"
    )
    try:
        render, base_url = start_render(logs / "render.log", [address], [])
        try:
            yield Launched(base_url, render, worker)
        finally:
            stop(render, timeout_s=15)
    finally:
        stop(worker, timeout_s=15)


def served_model(base_url: str) -> str:
    response = httpx.get(f"{base_url}/v1/models", timeout=10)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


class WorkerProbe:
    """A bare wire client of one worker that reads its heartbeats."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = make_dealer(self.context, address, identity=uuid.uuid4().bytes)
        self.socket.send(Encoder().encode(Hello(client_id="bench-probe")))
        self.decoder = WorkerMessageDecoder()

    def stats(self, timeout_s: float = 5.0) -> WorkerStats:
        """The newest heartbeat's stats (drains the older ones)."""
        deadline = time.monotonic() + timeout_s
        latest = None
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                if latest is not None:
                    return latest
                continue
            message = self.decoder.decode(self.socket.recv())
            if isinstance(message, Heartbeat):
                latest = message.stats
        if latest is None:
            raise RuntimeError("no heartbeat from the worker")
        return latest

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def is_idle(stats: WorkerStats) -> bool:
    """Nothing running or waiting, and every KV block free."""
    return (
        stats.num_running == stats.num_waiting == 0
        and stats.kv_blocks_free == stats.kv_blocks_total
    )
