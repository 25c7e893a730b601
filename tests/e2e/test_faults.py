"""Fault tests with real processes: a worker killed mid-stream, the only worker killed,
a render server killed. Each is bounded in time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Unpack

import httpx
import pytest

from tests.helpers.processes import (
    ServerProcess,
    WorkerOptions,
    WorkerProcess,
    kill_worker,
    start_render,
    start_worker,
    stop_server,
)
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48
PROMPTS = [
    "List the days of the week.",
    "Count from one to twenty in words.",
    "Name the planets of the solar system in order.",
    "Spell the English alphabet with commas.",
]


@contextlib.contextmanager
def two_workers_one_render(
    base: Path, heartbeat_timeout_s: int, **options: Unpack[WorkerOptions]
) -> Iterator[tuple[WorkerProcess, WorkerProcess, ServerProcess]]:
    """Two fresh workers (logs under `base`) behind one render server that declares a
    worker dead after `heartbeat_timeout_s` of silence. The workers are killed at the end,
    not drained: a fault test may have left them in any state."""
    with contextlib.ExitStack() as cleanup:
        workers = []
        for name in ("w1", "w2"):
            workers.append(start_worker(base / f"{name}.log", **options))
            cleanup.callback(kill_worker, workers[-1])
        addresses = [worker.address for worker in workers]
        args = ["--heartbeat-timeout", str(heartbeat_timeout_s)]
        render = start_render(addresses, base / "render.log", args)
        cleanup.callback(stop_server, render)
        yield workers[0], workers[1], render


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[WorkerProcess, WorkerProcess, ServerProcess]]:
    with two_workers_one_render(tmp_path_factory.mktemp("faults"), 2) as started:
        yield started


def chat_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    """A greedy chat request that runs to exactly `max_tokens` (EOS ignored)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def stream_chat(
    server: ServerProcess,
    prompt: str,
    max_tokens: int,
    started: threading.Event,
    timeout_s: float = 120,
) -> dict:
    """Stream one `chat_body` request; set `started` at its first content. Returns the
    text, the last finish_reason and the in-stream errors."""
    text, finish, errors = [], None, []
    body = chat_body(prompt, max_tokens, True)
    for event in _stream_events(server, "/v1/chat/completions", body, timeout_s):
        if "error" in event:
            errors.append(event["error"])
            continue
        for choice in event["choices"]:
            if choice["delta"].get("content"):
                text.append(choice["delta"]["content"])
                started.set()
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "finish": finish, "errors": errors}


def _stream_events(
    server: ServerProcess, path: str, body: dict, timeout_s: float
) -> Iterator[dict]:
    """The decoded data events of one streamed POST, up to `[DONE]`."""
    with (
        httpx.Client(base_url=server.base_url, timeout=timeout_s) as http,
        http.stream("POST", path, json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def test_kill_a_worker_mid_stream_every_stream_completes_identically(cluster) -> None:
    first, second, render = cluster
    reference = {
        prompt: httpx.post(
            f"{render.base_url}/v1/chat/completions",
            json=chat_body(prompt, MAX_TOKENS, False),
            timeout=120,
        ).json()["choices"][0]["message"]["content"]
        for prompt in PROMPTS
    }
    results: dict[str, dict] = {}
    started = [threading.Event() for _ in PROMPTS]

    def run(index: int, prompt: str) -> None:
        results[prompt] = stream_chat(render, prompt, MAX_TOKENS, started[index], 60)

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(PROMPTS)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "streams did not start"
    kill_worker(second)  # every stream it served must move to the first worker
    for thread in threads:
        thread.join(120)
    for prompt in PROMPTS:
        result = results[prompt]
        assert result["errors"] == [], result["errors"]
        assert result["finish"] == "length"
        assert result["text"] == reference[prompt]
    metrics = httpx.get(f"{render.base_url}/metrics").text
    assert "duet_worker_alive" in metrics


def test_kill_the_only_worker_fails_fast(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("only-worker")
    worker = start_worker(base / "w.log")
    render = start_render([worker.address], base / "render.log", ["--heartbeat-timeout", "2"])
    try:
        started = threading.Event()
        outcome: dict = {}
        thread = threading.Thread(
            target=lambda: outcome.update(stream_chat(render, PROMPTS[0], MAX_TOKENS, started, 60))
        )
        thread.start()
        assert started.wait(60)
        killed_at = time.monotonic()
        kill_worker(worker)
        thread.join(10)
        assert not thread.is_alive(), "the stream hung"
        assert time.monotonic() - killed_at < 5
        assert outcome["errors"]
        assert outcome["errors"][0]["code"] == "worker_lost"
        response = httpx.post(
            f"{render.base_url}/v1/chat/completions",
            json=chat_body("hi", MAX_TOKENS, False),
            timeout=10,
        )
        assert response.status_code == 503
        assert response.headers.get("retry-after")
        assert httpx.get(f"{render.base_url}/ready").status_code == 503
    finally:
        stop_server(render)
        kill_worker(worker)


def test_kill_a_render_server_frees_its_requests_on_the_worker(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.e2e.test_openai_api import _Heartbeats

    base = tmp_path_factory.mktemp("render-dies")
    worker = start_worker(base / "w.log", ["--client-timeout", "2"])
    render = start_render([worker.address], base / "render.log")
    probe = _Heartbeats(worker.address)
    try:
        started = threading.Event()
        body = chat_body(PROMPTS[1], 2000, True)

        def stream() -> None:
            try:
                with (
                    httpx.Client(base_url=render.base_url, timeout=60) as http,
                    http.stream("POST", "/v1/chat/completions", json=body) as response,
                ):
                    for line in response.iter_lines():
                        if '"content"' in line and '"content":""' not in line:
                            started.set()
            except httpx.HTTPError:
                pass  # the server is killed under it

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60)
        wait_until(
            lambda: probe.latest(1.0).stats.num_running >= 1,
            5,
            "the worker to show the request running",
            interval_s=0,
        )
        os.kill(render.process.pid, signal.SIGKILL)

        def freed() -> bool:
            stats = probe.latest(1.0).stats
            return stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total

        wait_until(freed, 10, "the worker to let the dead render server's request go", interval_s=0)
    finally:
        probe.close()
        stop_server(render)
        kill_worker(worker)


def _stream_generate(server: ServerProcess, token_ids: list[int], started: threading.Event) -> dict:
    """Stream a greedy /inference/v1/generate of MAX_TOKENS tokens (EOS ignored); set
    `started` at its first token. Returns the token ids, the finish and in-stream errors."""
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    body = {"token_ids": token_ids, "sampling_params": sampling, "stream": True}
    ids: list[int] = []
    finish, errors = None, []
    for event in _stream_events(server, "/inference/v1/generate", body, 120):
        if "error" in event:
            errors.append(event["error"])
            continue
        for choice in event["choices"]:
            ids.extend(choice["token_ids"])
            started.set()
            finish = choice.get("finish_reason") or finish
    return {"token_ids": ids, "finish": finish, "errors": errors}


def test_kill_a_worker_mid_generate_stream_every_stream_completes_identically(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Token ids in, token ids out, through a failover: the streams a killed worker served
    move to the other one and end with exactly the greedy sequence."""
    with two_workers_one_render(tmp_path_factory.mktemp("generate-failover"), 2) as cluster:
        _, second, render = cluster
        prompts = [
            httpx.post(f"{render.base_url}/tokenize", json={"prompt": text}).json()["tokens"]
            for text in PROMPTS
        ]
        sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        reference = [
            httpx.post(
                f"{render.base_url}/inference/v1/generate",
                json={"token_ids": ids, "sampling_params": sampling},
                timeout=120,
            ).json()["choices"][0]["token_ids"]
            for ids in prompts
        ]
        results: dict[int, dict] = {}
        started = [threading.Event() for _ in prompts]

        def run(index: int) -> None:
            results[index] = _stream_generate(render, prompts[index], started[index])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60), "streams did not start"
        kill_worker(second)
        for thread in threads:
            thread.join(120)
        for index, expected in enumerate(reference):
            assert results[index]["errors"] == [], results[index]["errors"]
            assert results[index]["finish"] == "length"
            assert results[index]["token_ids"] == expected
