"""A streaming client that stops reading, over a real socket: its request must not keep
generating (and holding KV blocks on the worker) for nobody.

The client is a raw socket with a small receive buffer that sends a streamed chat request
with a large max_tokens and never reads. It also asks for small segments: on loopback
(64 KiB segments) the server's kernel send buffer would grow to megabytes, which take a
while to fill. Each SSE chunk carries 20 top logprobs, so the buffers fill within seconds;
past --stream-write-timeout-s the render server cuts the stream and must abort the worker
request, and the worker's heartbeat (seen in the render server's /metrics) shows it idle
again long before the request could have generated its max_tokens.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.processes import ServerProcess, WorkerProcess, running_render
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
WRITE_TIMEOUT_S = 1.0
MAX_TOKENS = 2000
"""Far more than generates before the deadline below: only a cut stream ends in time."""
CUT_WITHIN_S = 30.0
"""Filling the buffers takes ~3 s here; generating MAX_TOKENS ~40 s."""
FREED_WITHIN_S = 3.0
"""From the cut: a few heartbeats (a left-over stream ran on until its max_tokens)."""


@pytest.fixture(scope="module")
def impatient(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--stream-write-timeout-s", str(WRITE_TIMEOUT_S)]
    yield from running_render([worker_a], tmp_path_factory.mktemp("slow-client"), args)


def _worker_load(render: ServerProcess) -> tuple[float, float]:
    """(requests running, share of KV blocks in use) of the one worker, as its last
    heartbeat told the render server."""
    text = httpx.get(f"{render.base_url}/metrics", timeout=30).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("duet_worker_num_requests_running", "duet_worker_kv_cache_usage")
    }
    return values["duet_worker_num_requests_running"], values["duet_worker_kv_cache_usage"]


def _stalled_stream(render: ServerProcess) -> socket.socket:
    """A socket that sent a long streamed chat request and will never read the answer."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{render.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connecting: the window the client advertises is set from it.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    client.connect(("127.0.0.1", render.port))
    client.sendall(head + body)
    return client


def test_a_client_that_stops_reading_frees_its_worker_request(impatient: ServerProcess) -> None:
    # KeyError: no heartbeat reached the new server yet.
    idle = lambda: _worker_load(impatient) == (0, 0)  # noqa: E731
    wait_until(idle, 60, "an idle worker at the start", ignoring=(KeyError,))
    client = _stalled_stream(impatient)
    try:
        wait_until(lambda: _worker_load(impatient)[0] == 1, 60, "the stalled request to run")
        wait_until(lambda: "stopped reading" in impatient.log(), CUT_WITHIN_S, "the cut")
        wait_until(
            idle,
            FREED_WITHIN_S,
            "the cut stream's worker request to end and free its KV blocks",
            detail=lambda: _worker_load(impatient),
        )
    finally:
        client.close()
