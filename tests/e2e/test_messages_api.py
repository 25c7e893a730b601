"""Anthropic's Messages API through real processes and the `anthropic` SDK: plain and
streamed messages, tool use and tool results, thinking blocks, count_tokens, the render,
and errors in Anthropic's shape. A Messages body runs the chat path, so greedy output
and rendered prompts equal /v1/chat/completions' for the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic import Anthropic

from tests.helpers.processes import ServerProcess, WorkerProcess, running_render

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-messages-test"
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
"""The SDK no longer takes sampling fields; the API (and this server) still reads them."""
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "Name a colour."}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Current weather of a city", "input_schema": CITY}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
CALL_WEATHER: dict[str, Any] = {
    "tools": [WEATHER],
    "tool_choice": {"type": "tool", "name": "get_weather"},
    # Not thinking, the tool choice's constraint holds from the first token.
    "thinking": {"type": "disabled"},
}
# deepseek_r1 reads text before a </think> as reasoning, with or without <think>: any
# output of a model that never closes it is a thinking block.
PARSERS = ["--chat-template", "chatml_tools", "--enable-auto-tool-choice"]
PARSERS += ["--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"]
PARSERS += ["--api-key", KEY, "--max-body-bytes", "65536"]


@pytest.fixture(scope="module")
def client(render: ServerProcess) -> Anthropic:
    return Anthropic(base_url=render.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def parsers(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_render([worker_a], tmp_path_factory.mktemp("messages"), PARSERS)


@pytest.fixture(scope="module")
def tools_client(parsers: ServerProcess) -> Anthropic:
    return Anthropic(base_url=parsers.base_url, api_key=KEY, max_retries=0)


def _post(server: ServerProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    headers = {"x-api-key": KEY, **headers}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def _ok(server: ServerProcess, path: str, body: Any) -> Any:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """A named-event SSE body as (event, data) pairs; every data line is JSON."""
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def _error(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic error answer, its status and type checked."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    return message


def _text(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# --- plain messages -----------------------------------------------------------------------


def test_create_answers_a_message(client: Anthropic) -> None:
    message = client.messages.create(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=ASK, **GREEDY
    )
    assert message.id.startswith("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == MODEL
    [block] = message.content
    assert block.type == "text"
    assert block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert 0 < message.usage.output_tokens <= 8
    assert message.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens


def test_greedy_output_equals_chat_completions(render: ServerProcess) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, *ASK],
        "max_tokens": 16,
        "temperature": 0,
    }
    body = {"model": MODEL, "system": SYSTEM, "messages": ASK, "max_tokens": 16, "temperature": 0}
    completion = _ok(render, "/v1/chat/completions", chat)
    message = _ok(render, "/v1/messages", body)
    [choice] = completion["choices"]
    assert message["content"] == [{"type": "text", "text": choice["message"]["content"]}]
    reasons = {"length": "max_tokens", "stop": "end_turn"}
    assert message["stop_reason"] == reasons[choice["finish_reason"]]
    usage = message["usage"]
    assert usage["output_tokens"] == completion["usage"]["completion_tokens"]
    prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert prompt_tokens == completion["usage"]["prompt_tokens"]


def test_render_equals_the_chat_render(render: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        "max_tokens": 12,
        "stop_sequences": ["\n\n"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
    }
    chat = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        ],
        "max_tokens": 12,
        "stop": ["\n\n"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
    }
    rendered = _ok(render, "/v1/messages/render", body)
    expected = _ok(render, "/v1/chat/completions/render", chat)
    assert rendered["request_id"].startswith("msg_")
    del rendered["request_id"], expected["request_id"]
    assert rendered == expected


def test_stop_sequence_ends_the_message(client: Anthropic) -> None:
    free = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, **GREEDY)
    words = _text(free).split()
    if len(words) < 2:
        pytest.skip(f"the greedy answer has no second word: {_text(free)!r}")
    stop = words[1]
    message = client.messages.create(
        model=MODEL, max_tokens=16, messages=ASK, **GREEDY, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert _text(free).startswith(_text(message))
    assert stop not in _text(message)


def test_stream_sends_anthropics_events(client: Anthropic, render: ServerProcess) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 10, "temperature": 0}
    response = _post(render, "/v1/messages", body | {"stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = _events(response.text)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {delta["type"] for delta in deltas} == {"text_delta"}
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=10, **GREEDY)
    assert "".join(delta["text"] for delta in deltas) == _text(whole)
    assert events[-2][1]["delta"]["stop_reason"] == whole.stop_reason
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens

    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=10, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(final) == _text(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_counts_system_and_tools(
    client: Anthropic, tools_client: Anthropic, parsers: ServerProcess
) -> None:
    short = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK).input_tokens
    system = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Answer in one word."}]
    longer = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    assert longer.input_tokens > short > 0
    plain = tools_client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_tools = tools_client.messages.count_tokens(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
    ).input_tokens
    assert with_tools > plain
    rendered = _ok(parsers, "/v1/messages/render", {"model": MODEL, "messages": ASK} | {
        "tools": [WEATHER], "max_tokens": 8
    })  # fmt: skip
    assert len(rendered["token_ids"]) == with_tools


def test_output_format_constrains_the_text(client: Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 10}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model=MODEL,
        max_tokens=30,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(_text(message)), schema)


# --- tools ----------------------------------------------------------------------------------


def _call_weather(tools_client: Anthropic) -> anthropic.types.Message:
    return tools_client.messages.create(
        model=MODEL, max_tokens=40, messages=ASK_WEATHER, **GREEDY, **CALL_WEATHER
    )


def test_named_tool_choice_answers_tool_use(tools_client: Anthropic) -> None:
    message = _call_weather(tools_client)
    assert message.stop_reason == "tool_use", message
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_")
    assert call.name == "get_weather"
    assert isinstance(call.input, dict)
    jsonschema.validate(call.input, CITY)


def test_streamed_tool_use_sends_input_json(
    tools_client: Anthropic, parsers: ServerProcess
) -> None:
    body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 40, "temperature": 0}
    response = _post(parsers, "/v1/messages", body | CALL_WEATHER | {"stream": True})
    assert response.status_code == 200, response.text
    events = _events(response.text)
    [start] = [data for name, data in events if name == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["input"] == {}
    partial = "".join(
        data["delta"]["partial_json"]
        for name, data in events
        if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == _call_weather(tools_client).content[0].input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    with tools_client.messages.stream(
        model=MODEL, max_tokens=40, messages=ASK_WEATHER, **GREEDY, **CALL_WEATHER
    ) as stream:
        final = stream.get_final_message()
    [call] = final.content
    assert call.type == "tool_use"
    assert call.input == json.loads(partial)


def _round_trip(call: anthropic.types.ToolUseBlock, *, is_error: bool = False) -> list[Any]:
    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "18 degrees and sunny"}],
        "is_error": is_error,
    }
    return [
        *ASK_WEATHER,
        {"role": "assistant", "content": [call.model_dump()]},
        {"role": "user", "content": [result, {"type": "text", "text": "So?"}]},
    ]


def test_tool_result_round_trip(tools_client: Anthropic, parsers: ServerProcess) -> None:
    [call] = _call_weather(tools_client).content
    assert call.type == "tool_use"
    messages = _round_trip(call)
    answer = tools_client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=messages,
        tools=[WEATHER],
        thinking={"type": "disabled"},
        **GREEDY,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"]

    # The prompt is the chat conversation an OpenAI client would send for it.
    body = {"model": MODEL, "messages": messages, "tools": [WEATHER], "max_tokens": 8}
    rendered = _ok(parsers, "/v1/messages/render", body)
    function = {"name": "get_weather", "arguments": json.dumps(call.input)}
    chat = {
        "model": MODEL,
        "messages": [
            *ASK_WEATHER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
            {"role": "user", "content": [{"type": "text", "text": "So?"}]},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER["description"], "parameters": CITY
        }}],
        "max_tokens": 8,
    }  # fmt: skip
    expected = _ok(parsers, "/v1/chat/completions/render", chat)
    assert rendered["token_ids"] == expected["token_ids"]
    prompt = _ok(parsers, "/detokenize", {"tokens": rendered["token_ids"]})["prompt"]
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt

    failed = _ok(
        parsers, "/v1/messages/render", body | {"messages": _round_trip(call, is_error=True)}
    )
    prompt = _ok(parsers, "/detokenize", {"tokens": failed["token_ids"]})["prompt"]
    assert "<tool_response>\nError: 18 degrees and sunny\n</tool_response>" in prompt


# --- thinking -------------------------------------------------------------------------------


def test_thinking_blocks(tools_client: Anthropic, parsers: ServerProcess) -> None:
    thinking = tools_client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=ASK,
        **GREEDY,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    [block] = thinking.content
    assert block.type == "thinking"
    assert block.thinking
    assert block.signature == ""
    assert thinking.stop_reason in ("end_turn", "max_tokens")

    with tools_client.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=ASK,
        **GREEDY,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        kinds = {event.delta.type for event in stream if event.type == "content_block_delta"}
        final = stream.get_final_message()
    assert kinds == {"thinking_delta"}
    assert final.content == thinking.content

    # Told not to think, the whole output is the answer.
    plain = tools_client.messages.create(
        model=MODEL, max_tokens=8, messages=ASK, **GREEDY, thinking={"type": "disabled"}
    )
    [text] = plain.content
    assert text.type == "text"
    assert text.text.strip() == block.thinking.strip()

    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "thinking": {"type": "disabled"}}
    chat = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    rendered = _ok(parsers, "/v1/messages/render", body)
    expected = _ok(parsers, "/v1/chat/completions/render", chat)
    assert rendered["token_ids"] == expected["token_ids"]


def test_thinking_passed_back_is_accepted(tools_client: Anthropic) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Blue is common.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Blue."},
            ],
        },
        {"role": "user", "content": "Another one."},
    ]
    message = tools_client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=messages,
        thinking={"type": "disabled"},
    )
    assert message.content
    assert message.content[0].type == "text"


# --- errors ---------------------------------------------------------------------------------


def test_bad_request_is_an_anthropic_error(client: Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "bogus", "text": "x"}]}],
        )
    body: Any = caught.value.body
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in body["error"]["message"]


def _user(*blocks: dict[str, Any]) -> dict[str, Any]:
    """The fields of a body with one user turn of `blocks`."""
    return {"messages": [{"role": "user", "content": list(blocks)}]}


BAD_BODIES: dict[str, tuple[dict[str, Any], str]] = {
    "missing max_tokens": ({"model": MODEL, "messages": ASK}, "max_tokens"),
    "image block": (
        _user({"type": "image", "source": {}}),
        "not supported",
    ),
    "tool_result image": (
        _user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}),
        "not supported",
    ),
    "tool_use in a user turn": (
        _user({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
        "messages.0.content.0",
    ),
    "system role": ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    "no messages": ({"messages": []}, "messages"),
    "temperature": ({"temperature": 1.5}, "temperature"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "thinking budget": ({"thinking": {"type": "enabled", "budget_tokens": 5}}, "budget_tokens"),
    "tool_choice type": ({"tool_choice": {"type": "function"}}, "tool_choice"),
    "unknown tool": (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        "nope",
    ),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "s", "input_schema": {}}]},
        "tools.0.type",
    ),
    "stop sequence": ({"stop_sequences": [""]}, "stop_sequences"),
    "long prompt": ({"messages": [{"role": "user", "content": "x " * 9000}]}, "messages"),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_bodies_get_400s_in_anthropic_shape(render: ServerProcess, name: str) -> None:
    fields, named = BAD_BODIES[name]
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8} | fields
    if name == "missing max_tokens":
        body = fields
    for path in ("/v1/messages", "/v1/messages/render"):
        message = _error(_post(render, path, body), 400, "invalid_request_error")
        assert named in message, message


def test_other_errors_in_anthropic_shape(render: ServerProcess, client: Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="gpt-nothing", max_tokens=8, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    invalid = httpx.post(
        f"{render.base_url}/v1/messages",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert "JSON" in _error(invalid, 400, "invalid_request_error")
    _error(httpx.get(f"{render.base_url}/v1/messages"), 405, "invalid_request_error")
    _error(_post(render, "/v1/messages/nothing", {}), 404, "not_found_error")
    count = _post(render, "/v1/messages/count_tokens", {"model": MODEL, "messages": [5]})
    _error(count, 400, "invalid_request_error")
    # Every other route keeps OpenAI's shape.
    chat = _post(render, "/v1/chat/completions", {"model": MODEL})
    assert chat.status_code == 400
    assert set(chat.json()) == {"error"}


def test_auth_and_size_errors_in_anthropic_shape(parsers: ServerProcess) -> None:
    wrong = Anthropic(base_url=parsers.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=ASK)
    body: Any = caught.value.body
    assert body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"
    unkeyed = httpx.post(f"{parsers.base_url}/v1/messages/count_tokens", json={})
    _error(unkeyed, 401, "authentication_error")
    chat = httpx.post(f"{parsers.base_url}/v1/chat/completions", json={})
    assert chat.status_code == 401
    assert chat.json()["error"]["code"] == "invalid_api_key"
    big = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 70000}]}
    _error(_post(parsers, "/v1/messages", big), 413, "request_too_large")
