"""A burst of large inputs must not leave the render process at its peak memory."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import ServerProcess, start_server, stop_server
from tests.helpers.waiting import wait_until

ALLOWED_GROWTH_MB = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A render-only server of its own: the RSS measured is this test's alone."""
    log = tmp_path_factory.mktemp("memory") / "render-serve.log"
    server = start_server(["--render-only"], log)
    yield server
    stop_server(server)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send_huge_header(port: int, size: int) -> None:
    """A head of `size` bytes; the server refuses it (431 or a close) long before."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Huge: " + b"a" * size)
            sock.recv(4096)
        except OSError:
            pass  # reset mid-send: refused


def test_memory_returns_near_baseline_after_large_inputs(server: ServerProcess) -> None:
    """Two 5 MB prompts to /tokenize (over 1 M tokens each), a 100,000-deep JSON body
    and a 16 MB header: a few seconds later the render process's RSS is back within
    64 MB of where it was before them (without the trim it stays over 400 MB above)."""
    pid = server.process.pid
    big = "lorem ipsum dolor sit amet " * 200_000
    deep = '{"prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for _ in range(3):
            assert http.post("/tokenize", json={"prompt": "warm " * 100}).status_code == 200
        baseline = rss_mb(pid)
        for _ in range(2):
            response = http.post("/tokenize", json={"prompt": big})
            assert response.status_code == 200
            assert response.json()["count"] > 1_000_000
        deep_answer = http.post(
            "/tokenize", content=deep, headers={"content-type": "application/json"}
        )
        assert deep_answer.status_code == 400
        send_huge_header(server.port, 16 * 1024 * 1024)
        assert http.get("/health").status_code == 200

    wait_until(
        lambda: rss_mb(pid) - baseline <= ALLOWED_GROWTH_MB,
        10,
        f"render RSS back within {ALLOWED_GROWTH_MB} MB of its {baseline:.0f} MB baseline",
    )
