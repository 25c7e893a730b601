"""Schemathesis against render-serve's own OpenAPI spec, on real processes.

Every operation of `/openapi.json` gets schema-valid and schema-violating requests
(schemathesis' positive and negative modes): tokenize, detokenize, models and the admin
routes on a `--render-only` server; chat and completions on the session's `render`
server with a worker, with `max_tokens`, `n` and prompt batches capped so each
generation stays a few tokens. Whatever is sent: no 5xx (but the documented 503 of
generation on a render-only server), an answer within REQUEST_TIMEOUT_S, and every
error in OpenAI's shape. Each operation has a time budget, so the module stays bounded.

Half the bodies of tokenize, detokenize, chat and completions lay one to three fuzzed
fields over a valid body, so they get past validation and exercise what lies behind it.
DUET_FUZZ_VERBOSE=1 (with `pytest -s`) prints the calls and statuses per operation.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.helpers.processes import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 30.0
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
# What a --render-only server answers with a 503 (it cannot generate).
WORKER_PATHS = (*GENERATION_PATHS, "/inference/v1/generate", "/v1/responses")
MAX_GENERATED = 4
"""Most tokens (per choice) a fuzzed generation request may ask for."""


def _cap(value: Any, limit: int) -> Any:
    # Values past any sane bound stay, so the render server's own limits are still hit.
    if isinstance(value, int) and not isinstance(value, bool) and limit < value < 1 << 24:
        return limit
    return value


_MESSAGES_BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}
GOOD_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}]},
    "/v1/completions": {"model": MODEL, "prompt": "The capital of France is"},
    "/tokenize": {"messages": [{"role": "user", "content": "Hi."}]},
    "/detokenize": {"tokens": [1, 4093, 198, 2683]},
    "/v1/messages": _MESSAGES_BODY,
    "/v1/messages/count_tokens": _MESSAGES_BODY,
    "/v1/messages/render": _MESSAGES_BODY,
}


def _tame(path: str, body: Any, overlay: random.Random | None) -> Any:
    """Keep a fuzzed body cheap: a few tokens, few choices, few prompts.

    With `overlay`, only one to three of the fuzzed fields are laid over a valid body, so
    most such requests get past validation and generate, each with a few odd fields.
    """
    if not isinstance(body, dict):
        return body
    if overlay is not None:
        kept = overlay.sample(sorted(body), min(len(body), overlay.randint(1, 3)))
        body = {**GOOD_BODIES[path], **{key: body[key] for key in kept}}
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if key in body:
            body[key] = _cap(body[key], MAX_GENERATED)
    for key in ("n", "best_of"):
        if key in body:
            body[key] = _cap(body[key], 2)
    unbounded = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if path in GENERATION_PATHS and unbounded:
        body["max_tokens"] = MAX_GENERATED  # unset means "up to the context length"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:2]
    return body


def _check_error_shape(response: schemathesis.Response) -> str | None:
    try:
        payload = response.json()
    except ValueError:
        return f"error body is not JSON: {response.text[:200]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) - {"message", "type", "param", "code"}:
        return f"not an OpenAI error: {payload!r:.300}"
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"error without message/type: {payload!r:.300}"
    for key in ("param", "code"):
        if error.get(key) is not None and not isinstance(error[key], str):
            return f"error {key} is not a string: {payload!r:.300}"
    return None


def _check_stream(response: schemathesis.Response) -> str | None:
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return f"SSE event is not JSON: {line[:200]!r}"
        if "error" in event and set(event["error"]) - {"message", "type", "param", "code"}:
            return f"SSE error not in OpenAI shape: {event!r:.300}"
    return None


def _problem(response: schemathesis.Response, path: str, render_only: bool) -> str | None:
    status = response.status_code
    content_type = (response.headers.get("content-type") or [""])[0]
    if status >= 500 and not (status == 503 and render_only and path in WORKER_PATHS):
        return f"{status} from {path}: {response.text[:300]!r}"
    if status >= 400:
        return _check_error_shape(response)
    if content_type.startswith("text/event-stream"):
        if response.stream_cut_short and response.elapsed >= REQUEST_TIMEOUT_S:
            return f"the stream did not end within {REQUEST_TIMEOUT_S}s"
        return _check_stream(response)
    if content_type.startswith("application/json"):
        try:
            response.json()
        except ValueError:
            return f"200 with a body that is not JSON: {response.text[:200]!r}"
    return None


def _fuzz_operation(
    server: ServerProcess,
    operation: Any,
    session: requests.Session,
    *,
    examples: int,
    budget_s: float,
    render_only: bool,
) -> tuple[int, list[str]]:
    """Up to `examples` fuzzed calls of one operation within `budget_s`: how many were
    made, and every problem seen (collected, so one run reports them all)."""
    label = f"{operation.method.upper()} {operation.path}"
    cases = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
        GenerationMode.NEGATIVE
    )
    deadline = time.monotonic() + budget_s
    calls, problems = [0], []
    statuses: dict[int, int] = {}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, overlay=st.none() | st.randoms(use_true_random=False))
    def run(case: Any, overlay: random.Random | None) -> None:
        if time.monotonic() > deadline:
            return  # this operation's time is spent; let hypothesis wind down
        if operation.path in GOOD_BODIES:
            case.body = _tame(operation.path, case.body, overlay)
        calls[0] += 1
        sent = f"{case.body!r:.300}"
        try:
            response = case.call(
                base_url=server.base_url, session=session, timeout=REQUEST_TIMEOUT_S
            )
        except requests.Timeout:
            problems.append(f"{label}: no answer in {REQUEST_TIMEOUT_S}s <- {sent}")
            return
        except requests.ConnectionError as exc:
            problems.append(f"{label}: connection failed ({exc}) <- {sent}")
            return
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = _problem(response, operation.path, render_only)
        if problem is not None:
            problems.append(f"{label}: {problem} <- {sent}")

    run()
    if os.environ.get("DUET_FUZZ_VERBOSE"):
        print(f"{label}: {calls[0]} calls, statuses {sorted(statuses.items())}")
    return calls[0], problems


def _fuzz(
    server: ServerProcess,
    paths: tuple[str, ...] | None,
    *,
    examples: int,
    budget_s: float,
    render_only: bool,
) -> tuple[dict[str, int], list[str]]:
    """Fuzz every operation of the server's spec under `paths` (all when None)."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    calls: dict[str, int] = {}
    problems: list[str] = []
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            if paths is not None and operation.path not in paths:
                continue
            made, seen = _fuzz_operation(
                server,
                operation,
                session,
                examples=examples,
                budget_s=budget_s,
                render_only=render_only,
            )
            calls[f"{operation.method.upper()} {operation.path}"] = made
            problems += seen
    return calls, problems


@pytest.fixture(scope="module")
def render_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(["--render-only"], tmp_path_factory.mktemp("fuzz") / "render.log")
    yield server
    stop_server(server)


def test_fuzz_render_only_routes(render_only: ServerProcess) -> None:
    calls, problems = _fuzz(render_only, None, examples=40, budget_s=4.0, render_only=True)
    assert calls["POST /tokenize"] >= 10, calls
    assert calls["POST /detokenize"] >= 10, calls
    assert not problems, "\n".join(problems[:20])
    assert render_only.process.poll() is None
    assert "Traceback" not in render_only.log()


def test_fuzz_generation_routes_with_a_worker(render: ServerProcess) -> None:
    calls, problems = _fuzz(render, GENERATION_PATHS, examples=50, budget_s=25.0, render_only=False)
    assert all(count >= 5 for count in calls.values()), calls
    assert not problems, "\n".join(problems[:20])
    assert render.process.poll() is None
    # the server still generates normally afterwards
    reply = requests.post(
        f"{render.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"]
