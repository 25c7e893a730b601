"""The servers a benchmark measures, as subprocesses: a free port to put them on, bounded
waits for them to be ready, and a stop that escalates to SIGKILL."""

from __future__ import annotations

import select
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready_line(process: subprocess.Popen, marker: str, timeout_s: float) -> bool:
    """Read the process's (text) stdout until a line holds `marker`; False when it exits
    or `timeout_s` passes first. select() bounds each wait, even on a silent process."""
    stdout = process.stdout
    assert stdout is not None, "start the process with stdout=PIPE, text=True"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([stdout], [], [], 1.0)
        if not readable:
            continue
        line = stdout.readline()
        if marker in line:
            return True
        if not line and process.poll() is not None:
            return False
    return False


def wait_http_ok(url: str, process: subprocess.Popen, timeout_s: float, poll_s: float) -> bool:
    """Poll `url` until it answers 200; False when the process exits or `timeout_s` passes
    first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            return False
        time.sleep(poll_s)


def stop(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
