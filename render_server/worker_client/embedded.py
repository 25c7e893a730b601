"""The embedded default: a local gpu-worker that render-serve starts, waits for, and stops.

It runs as a child process on an ipc socket in a private temporary directory, so nothing
else on the machine can reach it, and it dies with its parent (PR_SET_PDEATHSIG on Linux)
even if render-serve is killed without cleanup.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_READY_PREFIX = "gpu-worker ready on "


class EmbeddedWorkerError(RuntimeError):
    """The local worker could not be started."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EmbeddedWorker:
    """A gpu-worker child process serving `model` on a private ipc socket."""

    def __init__(self, model: str, device: str = "auto", extra_args: list[str] | None = None):
        self.model = model
        self.device = device
        self.extra_args = list(extra_args or [])
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[str] | None = None
        self._output: collections.deque[str] = collections.deque(maxlen=40)
        self.address: str | None = None

    def start(self, timeout_s: float) -> str:
        """Spawn the worker and block until it serves; returns its ZMQ address."""
        if importlib.util.find_spec("torch") is None:
            raise EmbeddedWorkerError(
                "render-serve without --worker starts a local gpu-worker, which needs the "
                "`worker` extra (torch); install it, or pass --worker ADDR or --render-only"
            )
        self._tmpdir = tempfile.TemporaryDirectory(prefix="duet-")
        address = f"ipc://{Path(self._tmpdir.name) / 'worker.sock'}"
        command = [
            sys.executable, "-m", "gpu_worker.cli", "--model", self.model,
            "--bind", address, "--device", self.device, *self.extra_args,
        ]  # fmt: skip
        logger.info("starting the embedded gpu-worker: %s", " ".join(command))
        self._process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.1):
            if self._process.poll() is not None:
                tail = "\n".join(self._output)
                raise EmbeddedWorkerError(
                    f"the embedded gpu-worker exited with {self._process.returncode}:\n{tail}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedWorkerError(f"the embedded gpu-worker was not ready in {timeout_s}s")
        self.address = address
        return address

    def _pump(self, ready: threading.Event) -> None:
        # Keep reading so the child never blocks on a full pipe; echo its log lines.
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            line = line.rstrip("\n")
            self._output.append(line)
            if line.startswith(_READY_PREFIX):
                ready.set()
            else:
                print(f"[gpu-worker] {line}", file=sys.stderr, flush=True)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate the worker (SIGTERM, then SIGKILL) and remove its socket directory."""
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
