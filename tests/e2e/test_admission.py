"""Admission control and draining on a real render server: 429 past --max-pending, and
SIGTERM draining (/ready 503, new requests refused, in-flight streams finish, exit 0)."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.helpers.processes import ServerProcess, WorkerProcess, start_render, stop_server
from tests.helpers.waiting import wait_until

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


def _stream_in_background(base_url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streaming request in a thread, returned once its first content has arrived, so
    that it is surely in flight; `out` gets its status and finish_reason when it ends."""
    started, out = threading.Event(), {}
    thread = threading.Thread(target=_stream, args=(base_url, _body(max_tokens), started, out))
    thread.start()
    assert started.wait(60), "the stream did not start"
    return thread, out


def assert_sigterm_drains(render: ServerProcess, max_tokens: int) -> None:
    """SIGTERM with a `max_tokens` stream in flight: /ready turns 503 within 5 s, a new
    request is refused with 503 "draining", the stream runs to its end, and exit code 0."""
    thread, out = _stream_in_background(render.base_url, max_tokens)
    render.process.send_signal(signal.SIGTERM)

    def ready_is_503() -> bool:
        try:
            return httpx.get(f"{render.base_url}/ready", timeout=5).status_code == 503
        except httpx.TransportError:  # with --processes, a process closing its connections
            return False

    wait_until(ready_is_503, 5, "/ready to turn 503")
    refused = httpx.post(f"{render.base_url}/v1/chat/completions", json=_body(4, False), timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    thread.join(120)
    assert out["finish"] == "length", out  # the in-flight stream ran to its end
    assert render.process.wait(30) == 0


def test_max_pending_gives_429(worker_a: WorkerProcess, tmp_path) -> None:
    render = start_render([worker_a.address], tmp_path / "render.log", ["--max-pending", "1"])
    try:
        thread, out = _stream_in_background(render.base_url, 40)
        second = httpx.post(
            f"{render.base_url}/v1/chat/completions", json=_body(4, False), timeout=30
        )
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "too_many_pending"
        # Every generating API counts, each refusing in its own error shape.
        message = {"role": "user", "content": "Hi"}
        responses = httpx.post(f"{render.base_url}/v1/responses", json={"input": "Hi"}, timeout=30)
        assert responses.status_code == 429, responses.text
        assert responses.json()["error"]["code"] == "too_many_pending"
        messages = httpx.post(
            f"{render.base_url}/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": [message]},
            timeout=30,
        )
        assert messages.status_code == 429, messages.text
        assert messages.json()["type"] == "error"
        assert messages.json()["error"]["type"] == "rate_limit_error"
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
        assert_sigterm_drains(render, 60)
    finally:
        stop_server(render)
