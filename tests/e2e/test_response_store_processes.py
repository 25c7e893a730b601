"""Stored Responses API responses shared through a real Redis by render processes that
share nothing else: `render-serve --processes 2 --response-store redis://...` over the
session's worker, and a second render server on the same Redis.

Every call goes over a fresh connection (a new client each time), so the kernel hands
calls to either process; which one answered is read from the access log, whose lines
carry the process id. A response created through one process and read through both
proves the other read what it did not write.
"""

from __future__ import annotations

import re
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    running_render,
    spawn_server,
    start_render,
    stop_server,
)
from tests.helpers.redis import RedisServer, start_redis
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
ROUNDS = 8
"""Retrieve-and-continue rounds at the least; more until both processes answered."""
MAX_ROUNDS = 60
GIVE_UP_WITHIN_S = 10.0
"""A call on a dead Redis answers within the store's timeouts, well under this."""
_ACCESS = re.compile(r'\[(\d+)\] uvicorn\.access: \S+ - "(\w+) (\S+) HTTP/1\.1" 200')


def _answered_by(render: ServerProcess, method: str, path: str) -> Counter[str]:
    """Requests to `path` (a prefix) answered with 200, per render process id."""
    return Counter(
        pid
        for pid, seen_method, seen_path in _ACCESS.findall(render.log())
        if seen_method == method and seen_path.startswith(path)
    )


def _client(server: ServerProcess) -> OpenAI:
    """A new client, so a new connection, for one call."""
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def shared(
    worker_a: WorkerProcess, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Two render processes on one port, storing responses in the session's Redis."""
    redis_server.flush()
    args = ["--processes", "2", "--access-log", "--response-store", redis_server.url]
    log_path = tmp_path_factory.mktemp("render-redis") / "render.log"
    server = start_render([worker_a.address], log_path, args)
    try:
        # /ready answers once one process serves: wait for the second too.
        wait_until(
            lambda: server.log().count("Application startup complete") >= 2,
            120,
            "the second render process to start",
            detail=server.log,
        )
        yield server
    finally:
        stop_server(server)


def test_a_bad_store_url_stops_the_server_at_once(tmp_path: Path) -> None:
    args = ["--processes", "2", "--render-only", "--response-store", "mysql://user:secret@db/0"]
    server = spawn_server(args, tmp_path / "render.log")
    try:
        assert server.process.wait(60) == 2
    except subprocess.TimeoutExpired:
        stop_server(server)
        pytest.fail(f"render-serve started with a bad store URL:\n{server.log()}")
    log = server.log()
    assert "response_store" in log
    assert "use memory:// or redis://" in log
    assert "secret" not in log


def test_processes_on_the_memory_store_warn(worker_a: WorkerProcess, tmp_path: Path) -> None:
    server = start_render([worker_a.address], tmp_path / "render.log", ["--processes", "2"])
    try:
        assert "stored responses are per process" in server.log()
    finally:
        stop_server(server)
    assert server.process.returncode == 0


def test_both_processes_serve_with_the_redis_store(shared: ServerProcess) -> None:
    def both_answered() -> bool:
        assert httpx.get(f"{shared.base_url}/v1/models", timeout=30).status_code == 200
        return len(_answered_by(shared, "GET", "/v1/models")) == 2

    wait_until(both_answered, 60, "both processes to answer /v1/models", interval_s=0)


def test_stored_responses_are_read_and_continued_through_either_process(
    shared: ServerProcess,
) -> None:
    first = _client(shared).responses.create(
        model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0, store=True
    )
    assert first.status in ("completed", "incomplete")
    last = first
    rounds = 0
    while rounds < ROUNDS or (
        len(_answered_by(shared, "GET", f"/v1/responses/{first.id}")) < 2
        or len(_answered_by(shared, "POST", "/v1/responses")) < 2
    ):
        assert rounds < MAX_ROUNDS, f"one process took every call:\n{shared.log()}"
        rounds += 1
        again = _client(shared).responses.retrieve(first.id)
        assert (again.id, again.status, again.output_text) == (
            first.id,
            first.status,
            first.output_text,
        )
        following = _client(shared).responses.create(
            model=MODEL,
            input=f"And another, number {rounds}?",
            previous_response_id=last.id,
            max_output_tokens=4,
            temperature=0,
            store=True,
        )
        assert following.status in ("completed", "incomplete")
        assert following.previous_response_id == last.id
        assert _client(shared).responses.retrieve(following.id).output_text == (
            following.output_text
        )
        last = following
    # Only one process wrote `first`, and both read it.
    assert len(_answered_by(shared, "GET", f"/v1/responses/{first.id}")) == 2
    deleted = httpx.delete(f"{shared.base_url}/v1/responses/{first.id}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    for _ in range(4):  # gone for both processes
        gone = httpx.get(f"{shared.base_url}/v1/responses/{first.id}", timeout=30)
        assert gone.status_code == 404, gone.text


def test_input_items_are_listed_through_either_process(shared: ServerProcess) -> None:
    inputs: list[Any] = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "id": "msg_mine", "role": "user", "content": "Name a colour."},
    ]
    created = _client(shared).responses.create(model=MODEL, input=inputs, max_output_tokens=2)
    path = f"/v1/responses/{created.id}/input_items"
    rounds = 0
    while len(_answered_by(shared, "GET", path)) < 2:
        assert rounds < MAX_ROUNDS, f"one process took every call:\n{shared.log()}"
        rounds += 1
        listed = _client(shared).responses.input_items.list(created.id, order="asc")
        assert [(item.type, item.role) for item in listed.data] == [  # type: ignore[union-attr]
            ("message", "developer"),
            ("message", "user"),
        ]
        assert listed.data[1].id == "msg_mine"
        assert listed.has_more is False


@pytest.fixture(scope="module")
def other_server(
    worker_a: WorkerProcess, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A second render server on the same Redis: surely another process than `shared`'s."""
    args = ["--response-store", redis_server.url]
    yield from running_render([worker_a], tmp_path_factory.mktemp("render-redis-2"), args)


def test_a_cancel_through_another_server_stops_the_running_response(
    shared: ServerProcess, other_server: ServerProcess
) -> None:
    seen: list[str] = []
    started = threading.Event()

    def consume() -> None:
        with _client(shared).responses.stream(
            model=MODEL,
            input="Tell me a very long story.",
            max_output_tokens=400,
            extra_body={"ignore_eos": True},
        ) as stream:
            for event in stream:
                seen.append(event.type)
                if event.type == "response.created":
                    seen.append(event.response.id)
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        assert started.wait(60)
        response_id = seen[1]
        assert _client(other_server).responses.retrieve(response_id).status == "in_progress"
        cancelled = _client(other_server).responses.cancel(response_id)
    finally:
        reader.join(60)
    assert not reader.is_alive()
    assert cancelled.status == "cancelled"
    assert seen[-1] == "response.incomplete"
    stored = _client(shared).responses.retrieve(response_id)
    assert stored.status == "cancelled"
    assert stored.usage is not None
    assert stored.usage.output_tokens < 400


def test_a_dead_redis_is_a_quick_503_and_serving_resumes_with_it(
    worker_a: WorkerProcess, tmp_path: Path
) -> None:
    redis = start_redis(tmp_path)
    args = ["--response-store", redis.url]
    server = start_render([worker_a.address], tmp_path / "render.log", args)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "temperature": 0}
    try:
        created = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
        assert created.status_code == 200, created.text
        response_id = created.json()["id"]
        redis.stop()
        for method, path in [
            ("GET", f"/v1/responses/{response_id}"),
            ("POST", "/v1/responses"),
            ("DELETE", f"/v1/responses/{response_id}"),
        ]:
            json_body = body if method == "POST" else None
            answer = httpx.request(
                method, f"{server.base_url}{path}", json=json_body, timeout=GIVE_UP_WITHIN_S
            )
            assert answer.status_code == 503, answer.text
            assert redis.url.split("//")[1] not in answer.text  # no address to clients
        unstored = httpx.post(
            f"{server.base_url}/v1/responses", json={**body, "store": False}, timeout=60
        )
        assert unstored.status_code == 200, unstored.text
        redis.start()  # empty: nothing was persisted
        again = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
        assert again.status_code == 200, again.text
        stored = httpx.get(f"{server.base_url}/v1/responses/{again.json()['id']}", timeout=30)
        assert stored.status_code == 200, stored.text
    finally:
        stop_server(server)
        redis.stop()
