"""Input a schema cannot type answers 400 (or the model's 404), never a 500: nesting too
deep, lone surrogates, integers past int64, odd model names; and every 5xx is logged.

All against the session's render-only server: its bounds are checked before a generation
request needs a worker (which it would answer with 503)."""

from __future__ import annotations

import json

import httpx
import pytest

from render_server.schemas.body import MAX_JSON_DEPTH
from render_server.schemas.errors import MAX_QUOTED_CHARS
from tests.helpers.processes import ServerProcess
from tests.helpers.waiting import wait_until
from tests.integration.test_http_errors import assert_error

MODEL = "SmolLM2-135M-Instruct"
JSON = {"content-type": "application/json"}
USER = '{"role": "user", "content": "hi"}'


def nested(levels: int) -> str:
    """JSON text of `levels` objects, each inside the previous one."""
    return '{"a": ' * levels + "1" + "}" * levels


def post(client: httpx.Client, path: str, body: str | bytes) -> httpx.Response:
    """POST raw JSON text: the escapes under test must reach the server as written."""
    return client.post(path, content=body.encode() if isinstance(body, str) else body, headers=JSON)


def new_log(server: ServerProcess, since: int) -> str:
    return server.log()[since:]


DEEP = nested(600)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi", '
            f'"extra": {DEEP}}}]}}',
            "messages.0.extra.a",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{USER}], "chat_template_kwargs": {{"x": {DEEP}}}}}',
            "chat_template_kwargs.x.a.a",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{USER}], "documents": [{DEEP}]}}',
            "documents.0.a.a",
        ),
        (
            "/tokenize",
            f'{{"messages": [{USER}], "tools": [{{"type": "function", '
            f'"function": {{"name": "f", "parameters": {DEEP}}}}}]}}',
            "tools.0.function.parameters",
        ),
        (
            "/tokenize",
            f'{{"messages": [{{"role": "user", "content": "hi", "extra": {DEEP}}}]}}',
            "messages.0.extra.a",
        ),
        (
            "/v1/completions",
            f'{{"prompt": "x", "response_format": {DEEP}}}',
            "response_format.a.a.a",
        ),
    ],
)
def test_deep_nesting_is_a_400_naming_the_field(
    client: httpx.Client, render_server: ServerProcess, path: str, body: str, param: str
) -> None:
    log_start = len(render_server.log())
    error = assert_error(post(client, path, body), 400, param)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    assert "Traceback" not in new_log(render_server, log_start)


def test_nesting_up_to_the_bound_is_fine(client: httpx.Client) -> None:
    # The body is level 1, chat_template_kwargs level 2 and its innermost object `levels`.
    def body(levels: int) -> str:
        return f'{{"messages": [{USER}], "chat_template_kwargs": {nested(levels - 1)}}}'

    response = post(client, "/tokenize", body(MAX_JSON_DEPTH))
    assert response.status_code == 200, response.text
    too_deep = post(client, "/tokenize", body(MAX_JSON_DEPTH + 1))
    assert_error(too_deep, 400, "chat_template_kwargs.a.a.a")


def test_json_too_deep_to_parse_is_a_400(client: httpx.Client) -> None:
    levels = 200_000  # past what Python's JSON decoder recurses through
    body = '{"prompt": ' + "[" * levels + "]" * levels + "}"
    for path in ("/tokenize", "/v1/chat/completions"):
        error = assert_error(post(client, path, body), 400)
        assert error["code"] == "invalid_json"
        assert "deeper than" in error["message"]


# A lone surrogate as a client's JSON spells it; "<S>" in a body below stands for it.
SURROGATE = "a\\ud800b"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "<S>"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "<S>"}]}, "messages.0.content"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "<S>"}]}]},
            "messages.0.content.0.text",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"<S>": 1}},
            "chat_template_kwargs.a\\ud800b",
        ),
        ("/detokenize", {"tokens": [1], "model": "<S>"}, "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "<S>"}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"model": "<S>", "messages": []}, "model"),
        ("/v1/completions", {"prompt": ["ok", "<S>"]}, "prompt.1"),
        ("/v1/completions", {"prompt": "x", "stop": "<S>"}, "stop"),
    ],
)
def test_lone_surrogate_is_a_400(
    client: httpx.Client, path: str, body: dict[str, object], param: str
) -> None:
    text = json.dumps(body).replace("<S>", SURROGATE)
    error = assert_error(post(client, path, text), 400, param)
    assert "surrogate" in error["message"]


def test_lone_surrogate_as_raw_bytes_is_a_400(client: httpx.Client) -> None:
    # Python's JSON decoder reads UTF-8 with surrogatepass: encoded surrogates get in too.
    body = b'{"prompt": "a' + "\ud800".encode("utf-8", "surrogatepass") + b'b"}'
    assert_error(post(client, "/tokenize", body), 400, "prompt")


def test_surrogate_pairs_are_fine(client: httpx.Client) -> None:
    # What json.dumps sends for an emoji: a valid pair, decoded into one character.
    response = post(client, "/tokenize", '{"prompt": "smile \\ud83d\\ude00"}')
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("priority", [1 << 63, -(1 << 63) - 1, 10**30])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_priority_beyond_int64_is_a_400(client: httpx.Client, path: str, priority: int) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "priority": priority}
    assert_error(client.post(path, json=body), 400, "priority")


def test_negative_stop_token_id_is_a_400(client: httpx.Client) -> None:
    # The wire refuses it: sent on, the worker dropped the frame and the request hung.
    body = {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [5, -1]}
    assert_error(client.post("/v1/chat/completions", json=body), 400, "stop_token_ids.1")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"model": "", "prompt": "x"}),
        ("/detokenize", {"model": "", "tokens": [1]}),
    ],
)
def test_empty_model_is_a_404(client: httpx.Client, path: str, body: dict[str, object]) -> None:
    assert assert_error(client.post(path, json=body), 404, "model")["code"] == "model_not_found"


def test_a_huge_model_name_is_not_echoed_back(client: httpx.Client) -> None:
    name = "m" * 1_000_000
    response = client.post("/tokenize", json={"model": name, "prompt": "x"})
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found"
    assert len(response.content) < MAX_QUOTED_CHARS + 300
    assert "1000000 characters" in error["message"]


def test_every_5xx_is_logged_with_its_request_id_and_cause(
    client: httpx.Client, render_server: ServerProcess
) -> None:
    # A handler's 5xx, no exception involved: a render-only server cannot generate.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert assert_error(response, 503)["code"] == "render_only"
    request_id = response.headers["x-request-id"]

    def logged() -> bool:
        return any(
            request_id in line and "503" in line and "render_only" in line
            for line in render_server.log().splitlines()
        )

    wait_until(logged, 5.0, f"a log line for request {request_id}", detail=render_server.log)
    assert render_server.log().count(request_id) == 1
