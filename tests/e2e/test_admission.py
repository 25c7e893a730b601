"""Admission control and draining on a real render server: 429 past --max-pending, and
SIGTERM draining (/ready 503, new requests refused, in-flight streams finish, exit 0)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.e2e.conftest import WorkerProcess, start_render
from tests.integration.conftest import stop_server

MODEL = "SmolLM2-135M-Instruct"


def _body(max_tokens: int, stream: bool = True) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _stream(base_url: str, body: dict, started: threading.Event, out: dict) -> None:
    finish = None
    with (
        httpx.Client(base_url=base_url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        out["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    started.set()
                finish = choice.get("finish_reason") or finish
    out["finish"] = finish


def test_max_pending_gives_429(worker_a: WorkerProcess, tmp_path) -> None:
    render = start_render([worker_a.address], tmp_path / "render.log", ["--max-pending", "1"])
    try:
        started, out = threading.Event(), {}
        thread = threading.Thread(target=_stream, args=(render.base_url, _body(40), started, out))
        thread.start()
        assert started.wait(60)
        second = httpx.post(
            f"{render.base_url}/v1/chat/completions", json=_body(4, False), timeout=30
        )
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "too_many_pending"
        thread.join(120)
        assert out["finish"] == "length"
        third = httpx.post(
            f"{render.base_url}/v1/chat/completions", json=_body(4, False), timeout=60
        )
        assert third.status_code == 200
    finally:
        stop_server(render)


def test_sigterm_drains_then_exits_0(worker_a: WorkerProcess, tmp_path) -> None:
    render = start_render([worker_a.address], tmp_path / "render.log", ["--drain-timeout", "60"])
    try:
        started, out = threading.Event(), {}
        thread = threading.Thread(target=_stream, args=(render.base_url, _body(60), started, out))
        thread.start()
        assert started.wait(60)
        render.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(f"{render.base_url}/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503"
            time.sleep(0.05)
        refused = httpx.post(
            f"{render.base_url}/v1/chat/completions", json=_body(4, False), timeout=30
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        thread.join(120)
        assert out["finish"] == "length", out  # the in-flight stream ran to its end
        assert render.process.wait(30) == 0
    finally:
        stop_server(render)
