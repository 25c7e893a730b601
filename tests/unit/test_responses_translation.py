"""A Responses body as the chat body it runs as: input items as chat messages, tools,
tool_choice and text.format in chat's shapes, and the 400s of what has no chat meaning."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from render_server.http.api.responses_input import chat_body, input_messages, refuse_unsupported
from render_server.schemas.errors import ApiError
from render_server.schemas.responses_api import MAX_INPUT_ITEMS, ResponsesRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate(fields)


def _messages(body: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> Any:
    return input_messages(body, history or [])


def test_string_input_is_one_user_message() -> None:
    assert _messages(_request(input="Hi")) == [{"role": "user", "content": "Hi"}]


def test_items_become_chat_messages() -> None:
    body = _request(
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "T"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "A", "annotations": []}]},
            CALL,
            {**CALL, "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "2"}]},
        ]
    )  # fmt: skip
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert _messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "A",
            "reasoning_content": "T",
            "tool_calls": [{"id": "call_1", **call}, {"id": "call_2", **call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"},
    ]


def test_an_output_needs_its_call_here_or_in_the_history() -> None:
    output = {"type": "function_call_output", "call_id": "call_1", "output": "1"}
    with pytest.raises(ApiError) as caught:
        _messages(_request(input=[output]))
    assert caught.value.info.param == "input.0.call_id"
    history = [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function"}]}]
    assert _messages(_request(input=[output]), history)[0]["role"] == "tool"


def test_chat_body_carries_tools_choice_format_and_sampling() -> None:
    body = _request(
        input="Hi",
        instructions="Sys",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        max_output_tokens=7,
        top_k=3,
        ignore_eos=True,
        structured_outputs={"regex": "a"},
    )
    chat = chat_body(body, _messages(body))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.tools is not None
    assert chat.tools[0].function.name == "f"
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": None},
    }
    assert chat.requested_max_tokens() == (7, "max_output_tokens")
    assert (chat.top_k, chat.ignore_eos) == (3, True)
    assert chat.structured_outputs is not None
    assert chat.structured_outputs.regex == "a"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include.0"),
        ({"include": ["message.output_text.logprobs"]}, "include.0"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"n": 2}, "n"),
    ],
)
def test_unsupported_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        refuse_unsupported(_request(input="x", **fields))
    assert caught.value.status_code == 400
    assert caught.value.info.param == param


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "item_reference"),
        ({"tools": [{"type": "mcp"}]}, "tools.0.type", "mcp"),
        ({"tools": [{"type": "local_shell"}]}, "tools.0.type", "local_shell"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input.0.content.0.type",
            "input_file",
        ),
        ({"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}, "input", None),
    ],  # fmt: skip
)
def test_item_and_tool_kinds_are_checked_first(
    fields: dict[str, Any], param: str, named: str | None
) -> None:
    with pytest.raises(ValidationError) as caught:
        _request(**fields)
    [error] = caught.value.errors()
    assert error["ctx"]["param"] == param
    if named is not None:
        assert named in error["msg"]


def test_tool_choice_of_a_hosted_tool_is_refused() -> None:
    body = _request(input="x", tool_choice={"type": "file_search"})
    with pytest.raises(ApiError) as caught:
        chat_body(body, _messages(body))
    assert caught.value.info.param == "tool_choice"
