"""Every request ends with one complete result or one error, as a client sees it: over a
paused render server, past --request-timeout, on a full worker queue, and with tenants
isolated in the prefix cache (--prefix-cache-isolation per-key).

One CPU worker (one sequence at a time, one waiting, a 1.5 s client timeout) and two
render servers with two API keys: one isolating tenants, one with a 2 s request deadline.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    running_render,
    start_render,
    start_worker,
    stop_server,
    stop_worker,
)
from tests.helpers.waiting import wait_until

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
REQUEST_TIMEOUT_S = 2
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    directory = tmp_path_factory.mktemp("endings-worker")
    worker = start_worker(
        directory / "worker.log",
        ["--client-timeout", "1.5", "--max-waiting", "1", "--max-num-seqs", "1"],
    )
    yield worker
    stop_worker(worker)


def start_render_with(
    worker: WorkerProcess, directory: Path, args: list[str]
) -> Iterator[ServerProcess]:
    keys = ["--api-key", KEY_A, "--api-key", KEY_B]
    yield from running_render([worker], directory, [*keys, *args])


@pytest.fixture(scope="module")
def render(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("endings-render")
    yield from start_render_with(worker, directory, ["--prefix-cache-isolation", "per-key"])


@pytest.fixture(scope="module")
def render_deadline(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("endings-deadline")
    yield from start_render_with(worker, directory, ["--request-timeout", str(REQUEST_TIMEOUT_S)])


def headers(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(max_tokens: int, stream: bool, prompt: str = PROMPT) -> dict[str, object]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass
class StreamRead:
    text: str = ""
    errors: list[dict[str, object]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    done: bool = False
    """`[DONE]` ended it."""


def read_stream(lines: Iterable[str]) -> StreamRead:
    read = StreamRead()
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            read.done = True
            continue
        event = json.loads(data)
        if "error" in event:
            read.errors.append(event["error"])
            continue
        if event.get("usage"):
            read.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"]:
            read.text += choice["text"]
            read.finish_reason = choice["finish_reason"] or read.finish_reason
    return read


def test_a_paused_render_server_resumes_its_stream_whole(
    render: ServerProcess, worker: WorkerProcess
) -> None:
    """SIGSTOP the render server for 3 s mid-stream (the worker reaps it after 1.5 s and
    aborts its request): after SIGCONT the stream goes on where it stopped and ends with
    `[DONE]` and all its tokens (the exact-token check is in
    tests/integration/test_worker_liveness.py); the next request is served."""
    body = {**completion(120, stream=True), "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=render.base_url, headers=headers(), timeout=30) as http:
        seen: list[str] = []
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                seen.append(line)
                if sum(line.startswith("data: {") for line in seen) == 5:
                    break
            os.kill(render.process.pid, signal.SIGSTOP)
            try:
                wait_until(
                    lambda: "silent for" in Path(str(worker.log_path)).read_text(),
                    10,
                    "the worker to reap the paused render server",
                )
            finally:
                os.kill(render.process.pid, signal.SIGCONT)
            seen.extend(lines)
        read = read_stream(seen)
        assert read.errors == []
        assert read.finish_reason == "length"
        assert read.completion_tokens == 120
        assert read.done
        after = http.post("/v1/completions", json=completion(4, stream=False))
        assert after.status_code == 200, after.text


def test_past_the_request_timeout_a_request_ends_with_an_error(
    render_deadline: ServerProcess,
) -> None:
    """--request-timeout 2: a request that would run longer gets 504 (non-streamed) or an
    error event then `[DONE]` (streamed), and the worker is free again right after."""
    with httpx.Client(base_url=render_deadline.base_url, headers=headers(), timeout=60) as http:
        whole = http.post("/v1/completions", json=completion(5000, stream=False))
        assert whole.status_code == 504, whole.text
        assert whole.json()["error"]["code"] == "timeout"
        with http.stream("POST", "/v1/completions", json=completion(5000, stream=True)) as response:
            assert response.status_code == 200
            read = read_stream(response.iter_lines())
        assert [error["code"] for error in read.errors] == ["timeout"]
        assert read.done
        # The worker runs one sequence at a time: this is served only if both were aborted.
        quick = http.post("/v1/completions", json=completion(2, stream=False), timeout=10)
        assert quick.status_code == 200, quick.text


def test_a_full_worker_queue_is_a_503_before_the_stream_starts(render: ServerProcess) -> None:
    """One running, one waiting: a third streamed request gets a real 503 with
    Retry-After, not a 200 with an error event."""
    started = threading.Barrier(3)
    stop = threading.Event()

    def occupy() -> None:
        with (
            httpx.Client(base_url=render.base_url, headers=headers(), timeout=60) as http,
            http.stream("POST", "/v1/completions", json=completion(5000, True)) as response,
        ):
            started.wait(30)
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=occupy, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        started.wait(30)
        with (
            httpx.Client(base_url=render.base_url, headers=headers(), timeout=30) as http,
            http.stream("POST", "/v1/completions", json=completion(5, True)) as response,
        ):
            response.read()
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert json.loads(response.text)["error"]["code"] == "queue_full"
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def test_tenants_never_share_cached_prefixes(render: ServerProcess) -> None:
    """Per-key isolation: the same long prompt is a prefix-cache hit for the key that sent
    it before, and a miss for another key."""
    prompt = "You are a careful assistant for the harbour office. " * 12

    def cached_tokens(key: str) -> int:
        client = OpenAI(base_url=f"{render.base_url}/v1", api_key=key, max_retries=0)
        result = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, temperature=0
        )
        assert result.usage is not None
        assert result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    cached_tokens(KEY_A)
    assert cached_tokens(KEY_A) > 0
    assert cached_tokens(KEY_B) == 0


def test_streams_still_running_when_the_drain_times_out_end_with_an_error(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM with --drain-timeout 1 and a stream that needs far longer: it ends with an
    error event (`draining`) and `[DONE]`, not a cut body, and the server exits 0."""
    directory = tmp_path_factory.mktemp("endings-drain")
    server = start_render([worker.address], directory / "render.log", ["--drain-timeout", "1"])
    try:
        with (
            httpx.Client(base_url=server.base_url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=completion(5000, True)) as response,
        ):
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            server.process.send_signal(signal.SIGTERM)
            read = read_stream([first, *lines])
        assert [error["code"] for error in read.errors] == ["draining"]
        assert read.done
        assert server.process.wait(30) == 0
    finally:
        stop_server(server)
