"""vLLM's render API (/v1/*/render) and /server_info over real processes: a render is what
the generating endpoint would send a worker, the same on a --render-only server as on
one with workers, and its token ids are /tokenize's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from render_server.generation.structured import constraint_from_request
from render_server.schemas.generate_api import GenerateRequest
from render_server.schemas.generation import ChatCompletionRequest
from tests.helpers.processes import ServerProcess, start_server, stop_server

SERVED_NAME = "duet-render-test"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
CHAT = {
    "messages": MESSAGES,
    "request_id": "render-1",
    "n": 2,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.1,
    "seed": 7,
    "max_tokens": 5,
    "min_tokens": 1,
    "stop": ["\n\n"],
    "stop_token_ids": [2],
    "logprobs": True,
    "top_logprobs": 3,
    "logit_bias": {"42": 1.5},
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "cache_salt": "tenant-a",
}


@pytest.fixture(scope="module")
def render_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("render-only") / "render.log"
    server = start_server(["--render-only", "--served-model-name", SERVED_NAME], log)
    yield server
    stop_server(server)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30.0)


def _rendered(server: ServerProcess, path: str, body: dict[str, Any]) -> Any:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _without_model(rendered: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in rendered.items() if key != "model"}


def _tokenized(server: ServerProcess, body: dict[str, Any]) -> list[int]:
    return _rendered(server, "/tokenize", body)["tokens"]


def test_chat_render_is_the_same_without_a_worker(
    render: ServerProcess, render_only: ServerProcess
) -> None:
    full = _rendered(render, "/v1/chat/completions/render", CHAT)
    alone = _rendered(render_only, "/v1/chat/completions/render", CHAT)
    assert _without_model(full) == _without_model(alone)
    assert alone["model"] == SERVED_NAME
    assert full["token_ids"] == _tokenized(render, {"messages": MESSAGES})
    assert full["request_id"] == "chatcmpl-render-1"
    assert full["features"] is None
    assert full["stream"] is True
    assert full["stream_options"] == {"include_usage": True}
    assert full["cache_salt"] == "tenant-a"
    assert full["priority"] == 0
    sampling = full["sampling_params"]
    expected = {key: CHAT[key] for key in ("n", "temperature", "top_p", "top_k", "seed")}
    expected |= {"stop": ["\n\n"], "logprobs": 3, "logit_bias": {"42": 1.5}}
    expected |= {key: CHAT[key] for key in ("max_tokens", "min_tokens", "stop_token_ids")}
    expected |= {"skip_special_tokens": False, "include_stop_str_in_output": True}
    assert {key: sampling[key] for key in expected} == expected
    assert sampling["structured_outputs"] is None
    GenerateRequest.model_validate(full)  # what the generate endpoint takes


def test_max_tokens_unset_is_the_rest_of_the_context(render_only: ServerProcess) -> None:
    context = httpx.get(f"{render_only.base_url}/v1/models").json()["data"][0]["max_model_len"]
    rendered = _rendered(render_only, "/v1/chat/completions/render", {"messages": MESSAGES})
    assert rendered["sampling_params"]["max_tokens"] == context - len(rendered["token_ids"])
    assert rendered["stream"] is False
    assert rendered["request_id"].startswith("chatcmpl-")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_choice_renders_tools_and_their_constraint(
    render: ServerProcess, render_only: ServerProcess, tool_choice: Any
) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": 8}
    full = _rendered(render, "/v1/chat/completions/render", body)
    assert _without_model(full) | {"request_id": ""} == _without_model(
        _rendered(render_only, "/v1/chat/completions/render", body)
    ) | {"request_id": ""}
    assert full["token_ids"] == _tokenized(render, {"messages": MESSAGES, "tools": [WEATHER]})
    assert full["token_ids"] != _tokenized(render, {"messages": MESSAGES})
    assert "json" in full["sampling_params"]["structured_outputs"]
    GenerateRequest.model_validate(full)


@pytest.mark.parametrize(
    "constraint",
    [
        {"structured_outputs": {"choice": ["a", "b"]}},
        {"structured_outputs": {"regex": "[ab]+"}},
        {"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
        {"guided_json": CITY},
    ],
)
def test_request_constraint_is_structured_outputs(
    render_only: ServerProcess, constraint: dict[str, Any]
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, **constraint}
    rendered = _rendered(render_only, "/v1/chat/completions/render", body)
    # The generate endpoint reads back the very constraint the chat would have run.
    read_back = constraint_from_request(GenerateRequest.model_validate(rendered).sampling_fields())
    original = constraint_from_request(ChatCompletionRequest.model_validate(body))
    assert original is not None
    assert read_back is not None
    assert read_back[0] == original[0]


def test_completions_render_one_request_per_prompt(
    render: ServerProcess, render_only: ServerProcess
) -> None:
    text = "The capital of France is"
    ids = _tokenized(render, {"prompt": text})
    for prompt, expected in [
        (text, [ids]),
        ([text, "Hello"], [ids, _tokenized(render, {"prompt": "Hello"})]),
        (ids, [ids]),
        ([ids, [1, 2, 3]], [ids, [1, 2, 3]]),
    ]:
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "request_id": "c"}
        full = _rendered(render, "/v1/completions/render", body)
        alone = _rendered(render_only, "/v1/completions/render", body)
        assert [_without_model(item) for item in full] == [_without_model(i) for i in alone]
        assert [item["token_ids"] for item in full] == expected
        assert all(item["sampling_params"]["max_tokens"] == 3 for item in full)
        assert all(item["sampling_params"]["temperature"] == 0 for item in full)
        assert len({item["request_id"] for item in full}) == len(expected)
        for item in full:
            GenerateRequest.model_validate(item)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**7}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True}, None),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, None),
        ("/v1/completions", {"prompt": [[1, 10**9]]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**63}, "seed"),
    ],
)
def test_render_refuses_what_generation_refuses(
    render: ServerProcess,
    render_only: ServerProcess,
    path: str,
    body: dict[str, Any],
    param: str | None,
) -> None:
    generating = _post(render, path, body)
    assert generating.status_code == 400, generating.text
    for server in (render, render_only):
        response = _post(server, f"{path}/render", body)
        assert response.status_code == 400, response.text
        assert response.json() == generating.json()
        if param is not None:
            assert response.json()["error"]["param"] == param


def test_unknown_model_is_a_404(render_only: ServerProcess) -> None:
    body = {"messages": MESSAGES, "model": "another"}
    assert _post(render_only, "/v1/chat/completions/render", body).status_code == 404


def test_server_info(render: ServerProcess, render_only: ServerProcess) -> None:
    full = httpx.get(f"{render.base_url}/server_info").json()
    alone = httpx.get(f"{render_only.base_url}/server_info").json()
    assert (full["role"], alone["role"]) == ("render+generate", "render")
    assert alone["model"] == SERVED_NAME
    assert full["model"] != SERVED_NAME
    assert full["schema_version"] == alone["schema_version"] == 1
    assert full["render_fingerprint"] == alone["render_fingerprint"]
    info = full["render_fingerprint"]["info"]
    assert len(full["render_fingerprint"]["digest"]) == 64
    assert info["tokenizer_digest"]
    assert info["chat_template_sha256"]
