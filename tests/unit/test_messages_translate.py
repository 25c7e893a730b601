"""The Messages API's translation into a chat body, its content blocks and stop reasons,
and its error shape: no server needed."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from render_server.http.api.messages import chat_fields, to_chat
from render_server.http.api.messages_format import (
    BlockWriter,
    MessagesFormatter,
    sse,
    stop_reason,
)
from render_server.http.errors import (
    anthropic_error_type,
    is_anthropic_route,
    validation_error_info,
)
from render_server.parsing.chat_output import ChoicePiece, ChoiceProcessor
from render_server.parsing.tool_choice import ToolPlan
from render_server.schemas.errors import ApiError
from render_server.schemas.messages_api import (
    ContentBlockDelta,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ToolUseBlock,
)
from render_server.schemas.responses import FunctionDeltaOut, ToolCallDeltaOut

BASE: dict[str, Any] = {"model": "m", "max_tokens": 8}


def _fields(**body: Any) -> dict[str, Any]:
    return chat_fields(MessagesRequest.model_validate(BASE | body))


def test_plain_conversation_is_the_chat_one() -> None:
    fields = _fields(
        system="Be terse.",
        messages=[{"role": "user", "content": "Hi"}],
        stop_sequences=["\n"],
        temperature=0.5,
        top_k=3,
        metadata={"user_id": "u1"},
    )
    assert fields["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]
    assert fields["add_generation_prompt"] is True
    assert fields["continue_final_message"] is False
    assert fields["stop"] == ["\n"]
    assert (fields["temperature"], fields["top_k"], fields["user"]) == (0.5, 3, "u1")
    assert fields["max_tokens"] == 8
    assert "chat_template_kwargs" not in fields


def test_blocks_become_chat_messages_in_order() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True},
                {"type": "text", "text": "And?"},
            ],
        },
    ]
    fields = _fields(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                     messages=messages)  # fmt: skip
    assert fields["messages"] == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
            "reasoning_content": "Use the tool.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: "},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
    ]
    to_chat(MessagesRequest.model_validate(BASE | {"messages": messages}))  # chat accepts it


def test_last_assistant_turn_is_a_prefill() -> None:
    fields = _fields(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    )
    assert fields["add_generation_prompt"] is False
    assert fields["continue_final_message"] is True


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}, None),
        ({"type": "none"}, "none", None),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any, parallel: bool | None) -> None:
    tools = [{"name": "w", "description": "d", "input_schema": {"type": "object"}}]
    fields = _fields(messages=[{"role": "user", "content": "Hi"}], tools=tools, tool_choice=choice)
    assert fields["tool_choice"] == expected
    assert fields["parallel_tool_calls"] == parallel
    function = {"name": "w", "description": "d", "parameters": {"type": "object"}}
    assert fields["tools"] == [{"type": "function", "function": function}]


@pytest.mark.parametrize(
    ("thinking", "enabled"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
    ],
)
def test_thinking_is_the_templates_switch(thinking: dict[str, Any], enabled: bool) -> None:
    fields = _fields(messages=[{"role": "user", "content": "Hi"}], thinking=thinking)
    assert fields["chat_template_kwargs"] == {"enable_thinking": enabled}


def test_output_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fields = _fields(
        messages=[{"role": "user", "content": "Hi"}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
    )
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_count_tokens_needs_no_max_tokens() -> None:
    body = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert to_chat(body).max_tokens is None


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ([{"type": "bogus"}], "messages.0.content.0"),
        ([{"type": "image", "source": {}}], "not supported"),
        ([{"type": "document", "source": {}}], "not supported"),
        ([{"type": "text"}], "text"),
        (5, "messages.0.content"),
    ],
)
def test_bad_blocks_are_refused(content: Any, named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        MessagesRequest.model_validate(BASE | {"messages": [{"role": "user", "content": content}]})
    # As the client reads it: http/errors.py drops the union's `<...>` location steps.
    assert named in validation_error_info(caught.value.errors(), "application/json").message


def test_misplaced_blocks_are_400s() -> None:
    tool_use = {"type": "tool_use", "id": "t", "name": "w", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t"}
    for role, block in (("user", tool_use), ("assistant", result)):
        body = MessagesRequest.model_validate(
            BASE | {"messages": [{"role": role, "content": [block]}]}
        )
        with pytest.raises(ApiError) as caught:
            to_chat(body)
        assert caught.value.status_code == 400
        assert "messages.0.content.0" in caught.value.info.message


def _call(name: str, arguments: str) -> ToolCallDeltaOut:
    return ToolCallDeltaOut(0, "call_x", "function", FunctionDeltaOut(name, arguments))


def test_block_writer_streams_what_it_builds() -> None:
    writer = BlockWriter()
    events = writer.add(ChoicePiece(reasoning="Hmm"))
    events += writer.add(ChoicePiece(reasoning=" ok", content="\n"))
    events += writer.add(ChoicePiece(content="Yes"))
    events += writer.add(ChoicePiece(tool_calls=[_call("w", '{"city": "Paris"}')]))
    events += writer.add(ChoicePiece(content="\n"))  # around a call: not an answer
    events += writer.finish(called_tools=True)
    [thinking, text, call] = writer.blocks
    assert thinking == ThinkingBlock("Hmm ok", "")
    assert text == TextBlock("\nYes")
    assert isinstance(call, ToolUseBlock)
    assert call.id.startswith("toolu_")
    assert (call.name, call.input) == ("w", {"city": "Paris"})
    names = [type(event).__name__ for event in events]
    assert names == [
        "ContentBlockStart", "ContentBlockDelta", "ContentBlockDelta", "ContentBlockStop",
        "ContentBlockStart", "ContentBlockDelta", "ContentBlockStop",
        "ContentBlockStart", "ContentBlockDelta", "ContentBlockStop",
    ]  # fmt: skip
    assert [getattr(event, "index", None) for event in events] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_whitespace_only_answer_is_kept_without_calls() -> None:
    writer = BlockWriter()
    assert writer.add(ChoicePiece(content=" \n")) == []
    events = writer.finish(called_tools=False)
    assert writer.blocks == [TextBlock(" \n")]
    assert len(events) == 3


def test_tool_input_is_always_an_object() -> None:
    writer = BlockWriter()
    writer.add(ChoicePiece(tool_calls=[_call("w", "[1, 2]"), _call("v", "")]))
    inputs = [block.input for block in writer.blocks if isinstance(block, ToolUseBlock)]
    assert inputs == [{"value": [1, 2]}, {}]


class _Choice:
    def __init__(self, finish_reason: str, stop: int | str | None = None) -> None:
        self.finish_reason = finish_reason
        self.stop_reason = stop


@pytest.mark.parametrize(
    ("finish", "stop", "called", "expected"),
    [
        ("length", None, False, ("max_tokens", None)),
        ("length", None, True, ("max_tokens", None)),
        ("stop", None, True, ("tool_use", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 2, False, ("end_turn", None)),
        ("stop", None, False, ("end_turn", None)),
    ],
)
def test_stop_reason(finish: str, stop: int | str | None, called: bool, expected: Any) -> None:
    assert stop_reason(_Choice(finish, stop), called) == expected


def test_events_are_named_sse() -> None:
    event = sse(ContentBlockDelta(0, TextDelta("hi")))
    name, data = event.decode().strip().split("\n")
    assert name == "event: content_block_delta"
    assert msgspec.json.decode(data.removeprefix("data: ")) == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "hi"},
    }


def test_error_types_and_routes() -> None:
    assert [anthropic_error_type(status) for status in (400, 401, 404, 413, 429, 503, 500)] == [
        "invalid_request_error",
        "authentication_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "overloaded_error",
        "api_error",
    ]
    assert anthropic_error_type(422) == "invalid_request_error"
    assert anthropic_error_type(504) == "api_error"
    assert is_anthropic_route("/v1/messages")
    assert is_anthropic_route("/v1/messages/count_tokens")
    assert not is_anthropic_route("/v1/messagesx")
    assert not is_anthropic_route("/v1/chat/completions")


def test_an_error_after_the_start_is_an_error_event() -> None:
    formatter = MessagesFormatter("m", ChoiceProcessor(ToolPlan("none", None)))
    assert formatter.done_event == b""
    event = formatter.error_event(ApiError(503, "The workers are busy.", code="queue_full"))
    name, data = event.decode().strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "The workers are busy."},
    }
