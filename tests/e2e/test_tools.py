"""Tool calling and reasoning output through real processes and the openai SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.helpers.processes import ServerProcess, WorkerProcess, start_render, stop_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
BROKEN_CALL = '<tool_call>{"name": "get_time", "arguments": {bad json</tool_call>'
GOOD_CALL = '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>'


@pytest.fixture(scope="module")
def tools_server(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [
        "--chat-template", "chatml_tools", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--structured-outputs-in-reasoning",
    ]  # fmt: skip
    server = start_render([worker_a.address], tmp_path_factory.mktemp("tools") / "r.log", args)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def tools_client(tools_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="x", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_returns_valid_calls(tools_client: OpenAI, temperature) -> None:
    reply = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=temperature, seed=3,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streams_valid_arguments(tools_client: OpenAI) -> None:
    stream = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    first, arguments, finish = None, [], None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if first is None:
                    first = call
                arguments.append(call.function.arguments or "")
    assert first is not None
    assert first.id
    assert first.type == "function"
    assert first.function.name == "get_weather"
    _check_call("get_weather", "".join(arguments))
    assert finish == "tool_calls"
    whole = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert whole.choices[0].message.tool_calls[0].function.arguments == "".join(arguments)


def test_round_trip_call_result_answer(tools_client: OpenAI) -> None:
    first = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    final = tools_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_auto_tool_choice_gives_content_or_valid_calls(tools_client: OpenAI) -> None:
    reply = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0
    )
    message = reply.choices[0].message
    if message.tool_calls:
        assert reply.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            _check_call(call.function.name, call.function.arguments)
    else:
        assert message.content
        assert "<tool_call>" not in message.content


def test_the_default_server_reads_the_models_calls(client: OpenAI) -> None:
    """No flags (`make serve`): tool requests render with chatml_tools and "auto" reads its
    hermes calls. The model is made to write one call (a choice of one string)."""
    request = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 40, "temperature": 0,
        "extra_body": {"structured_outputs": {"choice": [GOOD_CALL]}},
    }  # fmt: skip
    choice = client.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert (choice.message.content, calls) == (None, [("get_time", '{"timezone": "UTC"}')])
    assert choice.finish_reason == "tool_calls"


def test_plain_chat_renders_with_the_models_own_template(
    client: OpenAI, render: ServerProcess
) -> None:
    """The built-in tools template is for tool requests only: a plain chat's prompt is the
    model's own template's, token for token (/tokenize renders with it)."""
    tokenized = httpx.post(
        f"{render.base_url}/tokenize", json={"messages": ASK, "add_generation_prompt": True}
    ).json()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert plain.usage.prompt_tokens == tokenized["count"]
    shown = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert shown.usage.prompt_tokens > tokenized["count"] + 100  # the tools, described


def _complete_calls(text: str) -> list[tuple[str, str]]:
    """The whole `{"name", "parameters"}` objects at the start of a cut JSON array."""
    decoder, calls, pos = json.JSONDecoder(), [], 1
    while True:
        pos = len(text) - len(text[pos:].lstrip(" ,"))
        try:
            call, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return calls
        calls.append((call["name"], json.dumps(call["parameters"], ensure_ascii=False)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_cut_call_list_keeps_its_complete_calls(client: OpenAI, stream: bool) -> None:
    """max_tokens ends a `required` answer inside its second call: the first is a tool
    call, the unfinished one is dropped, and no JSON is left in content."""
    request = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 30, "temperature": 0, "logprobs": True,
    }  # fmt: skip
    if stream:
        content, deltas, finish, tokens = "", {}, None, []
        for chunk in client.chat.completions.create(**request, stream=True):
            for streamed in chunk.choices:
                finish = streamed.finish_reason or finish
                content += streamed.delta.content or ""
                if streamed.logprobs is not None:
                    tokens += [entry.token for entry in streamed.logprobs.content or []]
                for call in streamed.delta.tool_calls or []:
                    deltas[call.index] = (call.function.name, call.function.arguments)
        calls = [deltas[index] for index in sorted(deltas)]
    else:
        choice = client.chat.completions.create(**request).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        tokens = [entry.token for entry in choice.logprobs.content]
    generated = "".join(tokens)
    assert len(_complete_calls(generated)) == 1, generated  # the cut is in the second call
    assert (calls, content, finish) == (_complete_calls(generated), "", "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_cut_named_call_is_no_call(client: OpenAI, stream: bool) -> None:
    request = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
        assert not any(delta.tool_calls or delta.content for delta in deltas)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        choice = client.chat.completions.create(**request).choices[0]
        assert (choice.message.tool_calls, choice.message.content) == (None, None)
        assert choice.finish_reason == "length"


def test_reasoning_is_split_from_the_answer(tools_client: OpenAI) -> None:
    # A regex constraint makes the small model "think" in qwen3's tags, deterministically
    # (this server applies constraints to the reasoning too; the default gate, which
    # constrains only the answer, is tested in tests/unit/test_structured_gate.py).
    pattern = r"<think>[a-z ]{5,30}</think>[A-Z][a-z]{2,10}\."
    body = {"structured_outputs": {"regex": pattern}}
    reply = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, extra_body=body
    )
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{5,30}", reasoning)
    assert re.fullmatch(r"[A-Z][a-z]{2,10}\.", message.content)
    stream = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, extra_body=body, stream=True
    )
    streamed_reasoning, streamed_content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            streamed_reasoning.append(extra.get("reasoning_content") or "")
            streamed_content.append(choice.delta.content or "")
    assert "".join(streamed_reasoning) == reasoning
    assert "".join(streamed_content) == message.content
    hidden = tools_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0,
        extra_body={**body, "include_reasoning": False},
    )  # fmt: skip
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None


@pytest.mark.parametrize(
    ("output", "calls", "finish"),
    [
        (BROKEN_CALL, [], "stop"),
        (BROKEN_CALL + GOOD_CALL, [("get_time", '{"timezone": "UTC"}')], "tool_calls"),
    ],
    ids=["broken", "broken-then-good"],
)
def test_a_broken_tool_call_stays_content(
    tools_client: OpenAI, output: str, calls: list[tuple[str, str]], finish: str
) -> None:
    """The model is made to write `output` (a choice of one string); a call whose JSON
    breaks is content, streamed or not, and only a well-formed call is a tool call."""
    request = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto",
        "max_tokens": 80, "temperature": 0,
        "extra_body": {"structured_outputs": {"choice": [output]}},
    }  # fmt: skip
    choice = tools_client.chat.completions.create(**request).choices[0]
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert (choice.message.content, whole, choice.finish_reason) == (BROKEN_CALL, calls, finish)
    content, streamed_calls, streamed_finish = [], [], None
    for chunk in tools_client.chat.completions.create(**request, stream=True):
        for streamed in chunk.choices:
            streamed_finish = streamed.finish_reason or streamed_finish
            content.append(streamed.delta.content or "")
            streamed_calls += [
                (c.function.name, c.function.arguments) for c in streamed.delta.tool_calls or []
            ]
    assert ("".join(content), streamed_calls, streamed_finish) == (BROKEN_CALL, calls, finish)
