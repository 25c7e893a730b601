"""One request's heavy work never stalls the event loop: while it runs, /health, polled on
another connection, answers within 100 ms every time (issue 13, items 5 and 6)."""

from __future__ import annotations

import contextlib
import gc
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.processes import ServerProcess
from tests.helpers.waiting import wait_until

MAX_STALL_S = 0.1
RENDER_DEADLINE_S = 1.0  # the render_server fixture's --render-deadline


def _text(chars: int) -> str:
    """Prose-like text behind a fresh uuid, so that no cache on the server has seen it."""
    words = (f"lorem{i % 1009} ipsum, dolor" for i in range(chars // 10))
    return f"{uuid.uuid4()} {' '.join(words)}"[:chars]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """A full collection of the heap earlier tests filled (transformers) takes 0.1-0.2 s."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _while_polling_health(
    server: ServerProcess, body: object, content_type: str = "application/json"
) -> tuple[httpx.Response, float, list[float]]:
    """POST `body` to /tokenize from a thread and poll /health until it is answered;
    returns the response, how long it took, and the latency of every /health answer
    meanwhile. Only the server's stalls may count, not this process's: the clients and
    the body are made first (an httpx client loads its CA bundle, a big body takes a while
    to encode, both holding the GIL), and the garbage collector waits until the end."""
    content = json.dumps(body).encode()
    latencies: list[float] = []
    with (
        _gc_paused(),
        ThreadPoolExecutor(1) as pool,
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
        httpx.Client(base_url=server.base_url, timeout=30.0) as probe,
    ):

        def timed() -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            response = client.post(
                "/tokenize", content=content, headers={"content-type": content_type}
            )
            return response, time.perf_counter() - started

        answered = pool.submit(timed)

        def health_then_answered() -> bool:
            started = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            return answered.done()

        wait_until(health_then_answered, 60.0, "the request to be answered", interval_s=0.02)
        response, elapsed = answered.result()
    return response, elapsed, latencies


@pytest.mark.parametrize(
    "content_type",
    # The fast path and, for any other JSON spelling, the FastAPI route behind it.
    ["application/json", "application/vnd.api+json"],
)
def test_long_prompt_tokenizes_off_the_loop(
    render_server: ServerProcess, content_type: str
) -> None:
    prompt = _text(600_000)  # a quarter to a whole second of tokenizing on one core
    response, _, latencies = _while_polling_health(
        render_server, {"prompt": prompt, "return_token_strs": True}, content_type
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 100_000
    assert len(latencies) >= 3, "the request was answered before /health could be probed"
    assert max(latencies) < MAX_STALL_S, f"/health stalled while tokenizing: {latencies}"


def test_big_integer_arithmetic_is_refused_within_the_deadline(
    render_server: ServerProcess,
) -> None:
    # Each squaring doubles the number; unchecked, the 24th alone is seconds of one C call.
    squaring = (
        "{% set ns = namespace(x=3) %}{% for i in range(24) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}{{ ns.x }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    response, elapsed, latencies = _while_polling_health(
        render_server, {"messages": messages, "chat_template": squaring}
    )
    assert response.status_code == 400, response.text
    assert "number of more than 65536 bits" in response.json()["error"]["message"]
    assert elapsed < RENDER_DEADLINE_S + 0.5
    assert max(latencies) < MAX_STALL_S, f"/health stalled while the template ran: {latencies}"


def test_one_long_c_call_in_a_template_is_stopped_at_the_deadline(
    render_server: ServerProcess,
) -> None:
    # Seconds of comparisons 30,000 characters long, all in one C call that holds the GIL:
    # only killing the process that renders the request's template stops it.
    long_call = "{% set s = 'a' * 30000 %}{% set x = 'a' * 29999 ~ 'b' %}{{ x in [s] * 3000000 }}"
    messages = [{"role": "user", "content": "hi"}]
    response, elapsed, latencies = _while_polling_health(
        render_server, {"messages": messages, "chat_template": long_call}
    )
    assert response.status_code == 400, response.text
    assert "longer than" in response.json()["error"]["message"]
    assert RENDER_DEADLINE_S <= elapsed < RENDER_DEADLINE_S + 0.5
    assert max(latencies) < MAX_STALL_S, f"/health stalled while the template ran: {latencies}"
