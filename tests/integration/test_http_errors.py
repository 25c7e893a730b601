"""Every error class answers in the OpenAI shape with the right status."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from render_server.http.api.deps import RenderState
from render_server.http.app import create_app
from render_server.http.metrics import RenderMetrics
from render_server.settings import RenderSettings

CHAT = [{"role": "user", "content": "hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is `{"error": {message, type, param, code}}` with `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert "Traceback" not in response.text
    assert error["param"] == param
    assert response.headers.get("x-request-id")
    return error


def test_unknown_route_404(client: httpx.Client) -> None:
    error = assert_error(client.get("/v1/nothing"), 404)
    assert "/v1/nothing" in error["message"]
    assert_error(client.get("/tokenize/"), 404)  # no trailing-slash redirect


def test_wrong_method_405(client: httpx.Client) -> None:
    response = client.get("/tokenize")
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"
    assert_error(client.post("/health"), 405)


def test_invalid_json_400(client: httpx.Client) -> None:
    response = client.post(
        "/tokenize", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert assert_error(response, 400)["code"] == "invalid_json"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_wrong_content_type_400(client: httpx.Client, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/tokenize", content=b'{"prompt": "x"}', headers=headers)
    assert assert_error(response, 400)["code"] == "unsupported_media_type"


def test_json_content_type_with_charset_is_fine(client: httpx.Client) -> None:
    response = client.post(
        "/tokenize",
        content=b'{"prompt": "x"}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200


@pytest.mark.parametrize("body", [b"[1, 2]", b'"prompt"', b"42", b"null", b""])
def test_body_not_an_object_400(client: httpx.Client, body: bytes) -> None:
    response = client.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": [*CHAT, {"role": "user", "content": [{"type": "image"}]}]},
            "messages.1.content.0.type",
        ),
        ({"messages": "hi"}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "add_special_tokns": True}, "add_special_tokns"),
        (
            {"messages": CHAT, "tools": [{"type": "function", "function": {}}]},
            "tools.0.function.name",
        ),
    ],
)
def test_validation_error_names_field(
    client: httpx.Client, body: dict[str, Any], param: str
) -> None:
    error = assert_error(client.post("/tokenize", json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")


def test_detokenize_validation(client: httpx.Client) -> None:
    assert_error(client.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens.0")
    assert_error(client.post("/detokenize", json={}), 400, "tokens")


def test_both_generation_prompt_and_continue_400(client: httpx.Client) -> None:
    body = {"messages": CHAT, "continue_final_message": True}
    error = assert_error(client.post("/tokenize", json=body), 400)
    assert "continue_final_message" in error["message"]


def test_body_too_large_413(client: httpx.Client) -> None:
    oversized = b'{"prompt": "' + b"a" * (8 * 1024 * 1024) + b'"}'
    response = client.post(
        "/tokenize", content=oversized, headers={"content-type": "application/json"}
    )
    assert assert_error(response, 413)["code"] == "request_too_large"


def test_chunked_body_too_large_413(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    # A generator body has no Content-Length: httpx sends it chunked.
    response = client.post(
        "/tokenize", content=chunks(), headers={"content-type": "application/json"}
    )
    assert assert_error(response, 413)["code"] == "request_too_large"


def test_chunked_body_within_limit_is_fine(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": '
        yield b'"hello"}'

    response = client.post(
        "/tokenize", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 200


def test_headers_too_large_431(client: httpx.Client) -> None:
    response = client.get("/health", headers={"x-filler": "a" * (70 * 1024)})
    assert assert_error(response, 431)["code"] == "request_headers_too_large"


def test_too_many_headers_431(client: httpx.Client) -> None:
    headers = [(f"x-filler-{index}", "1") for index in range(150)]
    assert_error(client.get("/health", headers=headers), 431)


def test_unhandled_exception_is_500_without_traceback() -> None:
    # No route of the real server fails on purpose, so this one is driven in-process:
    # a minimal state (no tokenizer is needed) and one route that raises.
    settings = RenderSettings()
    state = RenderState(
        settings=settings,
        model_id="m",
        root_model="m",
        created=0,
        version="0",
        tokenizer=None,  # type: ignore[arg-type]
        renderer=None,  # type: ignore[arg-type]
        metrics=RenderMetrics(),
        token_text=None,  # type: ignore[arg-type]
        generation_metrics=None,  # type: ignore[arg-type]
    )
    app = create_app(settings, state)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return await http.get("/boom", headers={"x-request-id": "boom-1"})

    response = asyncio.run(call())
    error = assert_error(response, 500)
    assert error["type"] == "server_error"
    assert "secret internal detail" not in response.text
    assert response.headers["x-request-id"] == "boom-1"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--chat-template", "/nonexistent/template.jinja"], "/nonexistent/template.jinja"),
        (["--port", "70000"], "port"),
    ],
)
def test_bad_startup_arguments_exit_2(args: list[str], expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "render_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "render-serve: error:" in result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
