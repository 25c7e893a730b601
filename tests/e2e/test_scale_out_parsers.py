"""The scale-out round trip with the output parsers on: render -> generate -> derender equals
/v1/chat/completions (greedy), streamed and not, with a tool-call parser (tool_choice auto
and a named function) and a reasoning parser, whose hold on a constraint (until the
reasoning ends) the generate endpoint decides from the prompt as the direct path does."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_scale_out_derender import (
    _comparable,
    _derender_stream,
    _ok,
    _post,
    _sse,
)
from tests.e2e.test_scale_out_render import MESSAGES, WEATHER
from tests.helpers.processes import ServerProcess, WorkerProcess, running_render

PARSERS = ["--chat-template", "chatml_tools", "--enable-auto-tool-choice"]
PARSERS += ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]

ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
ANSWER = r"[A-Z][a-z]{2,8}"
CLOSED_THINK = [
    *MESSAGES,
    {"role": "assistant", "content": "<think>One word.</think>"},
]

CHATS: dict[str, dict[str, Any]] = {
    "tool_choice_auto": {"messages": ASK_WEATHER, "tools": [WEATHER], "max_tokens": 32},
    "tool_choice_named": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 80,
    },
    # The prompt closed the reasoning: the constraint holds from the first token.
    "reasoning_closed_in_prompt": {
        "messages": CLOSED_THINK,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "structured_outputs": {"regex": ANSWER},
        "max_tokens": 8,
    },
}
THINKING: dict[str, Any] = {
    "messages": MESSAGES,
    "structured_outputs": {"regex": r"<think>[a-z ]{3,20}</think>" + ANSWER},
    "max_tokens": 40,
}


@pytest.fixture(scope="module")
def parsers(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_render([worker_a], tmp_path_factory.mktemp("parsers"), PARSERS)


@pytest.fixture(scope="module")
def reasoning(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Constraints hold in the reasoning too, so a regex makes the model think."""
    args = [*PARSERS, "--structured-outputs-in-reasoning"]
    yield from running_render([worker_a], tmp_path_factory.mktemp("reasoning"), args)


def _round_trip(server: ServerProcess, chat: dict[str, Any]) -> dict[str, Any]:
    """What /v1/chat/completions answers, checked against render -> generate -> derender."""
    direct = _ok(server, "/v1/chat/completions", chat)
    rendered = _ok(server, "/v1/chat/completions/render", chat)
    generated = _ok(server, "/inference/v1/generate", rendered)
    body = {"generate_response": generated, "chat_request": chat}
    assert _comparable(_ok(server, "/v1/chat/completions/derender", body)) == _comparable(direct)
    streamed = chat | {"stream": True, "stream_options": {"include_usage": True}}
    stream, _ = _derender_stream(server, streamed)
    response = _post(server, "/v1/chat/completions", streamed)
    assert response.status_code == 200, response.text
    assert _sse(stream) == _sse(response.text)
    message: dict[str, Any] = direct["choices"][0]["message"]
    return message


@pytest.mark.parametrize("name", list(CHATS))
def test_round_trip_with_parsers_equals_chat_completions(parsers: ServerProcess, name: str) -> None:
    message = _round_trip(parsers, CHATS[name] | {"temperature": 0})
    if name == "reasoning_closed_in_prompt":
        # Not held until a </think> the model never writes: the answer is constrained.
        assert re.fullmatch(ANSWER, message["content"]), message


def test_named_tool_round_trip_calls_it(reasoning: ServerProcess) -> None:
    # Here the tool choice's constraint holds from the first token (with the reasoning
    # held above, the model never ends a reasoning it never started).
    message = _round_trip(reasoning, CHATS["tool_choice_named"] | {"temperature": 0})
    assert message["tool_calls"][0]["function"]["name"] == "get_weather", message


def test_auto_tool_choice_round_trip_parses_the_call(reasoning: ServerProcess) -> None:
    # A regex writes the hermes call the parser reads, so the parser surely runs.
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
    chat = CHATS["tool_choice_auto"] | {"structured_outputs": {"regex": call}, "max_tokens": 40}
    message = _round_trip(reasoning, chat | {"temperature": 0})
    [parsed] = message["tool_calls"]
    assert parsed["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_round_trip_splits_the_reasoning(reasoning: ServerProcess) -> None:
    message = _round_trip(reasoning, THINKING | {"temperature": 0})
    assert message["reasoning_content"], message
    assert re.fullmatch(ANSWER, message["content"].strip()), message


def test_streamed_logprobs_round_trip_equals_the_chat_stream(render: ServerProcess) -> None:
    chat = {
        "messages": MESSAGES,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 2,
        "temperature": 0,
        "stream": True,
    }
    stream, _ = _derender_stream(render, chat)
    direct = _post(render, "/v1/chat/completions", chat)
    assert _sse(stream) == _sse(direct.text)
    assert any(event["choices"][0].get("logprobs") for event in _sse(stream) if event != "[DONE]")
