"""A Responses body as the chat body it runs as, and a response's output as the chat
messages the next turn continues from.

Input items become chat messages (developer as system, function calls merged into the
assistant turn they belong to, their outputs as tool messages, reasoning passed back as
the next assistant message's reasoning_content); tools, tool_choice and text.format take
chat's shapes, and every sampling extra goes through as chat reads it. What has no chat
meaning is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from render_server.http.api.deps import RenderState
from render_server.http.errors import validation_error_info
from render_server.schemas.errors import ApiError, quoted
from render_server.schemas.generation import ChatCompletionRequest, SamplingFields
from render_server.schemas.responses_api import (
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    ItemContent,
    MessageItem,
    OutputMessage,
    ReasoningOut,
    ResponseObject,
    ResponsesRequest,
)

# The sampling fields a Responses body hands to chat as they are; the rest are this
# API's own (text.format, max_output_tokens) or not chat's (stream_options).
_FORWARDED = frozenset(SamplingFields.model_fields) - {
    "stream",
    "stream_options",
    "response_format",
    "n",
    "best_of",
}
HARMLESS_INCLUDES = frozenset(
    {
        # About hosted tools, which are refused anyway: nothing to include.
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)


class _ResponsesChat(ChatCompletionRequest):
    """The chat body a Responses body becomes: limits name the Responses field."""

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_output_tokens"
        return self.max_tokens, "max_tokens"


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise ApiError(400, "background responses are not supported.", param="background")
    if body.truncation == "auto":
        raise ApiError(
            400, 'truncation "auto" is not supported; use "disabled".', param="truncation"
        )
    if body.n != 1:
        raise ApiError(400, "a response has one output: n must be 1.", param="n")
    for name in ("conversation", "prompt"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} is not supported by this server.", param=name)
    if body.top_logprobs:
        raise ApiError(400, "logprobs are not supported by /v1/responses.", param="top_logprobs")
    if body.reasoning is not None and body.reasoning.effort is not None:
        raise ApiError(
            400, "reasoning.effort is not supported by this model.", param="reasoning.effort"
        )
    check_include(body.include or [], HARMLESS_INCLUDES)


def check_include(values: list[str], supported: frozenset[str]) -> None:
    """A 400 naming the first `include` value outside `supported`."""
    for index, value in enumerate(values):
        if value not in supported:
            raise ApiError(
                400, f"include value {quoted(value)!r} is not supported.", param=f"include.{index}"
            )


def _text(content: ItemContent) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if len(content) == 1:
        return content[0].as_text
    return [{"type": "text", "text": part.as_text} for part in content]


def _plain_text(content: ItemContent) -> str:
    return content if isinstance(content, str) else "".join(p.as_text for p in content)


def _known_calls(messages: list[dict[str, Any]]) -> set[str]:
    return {
        call["id"]
        for message in messages
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict) and "id" in call
    }


def input_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages (instructions not included: they hold for this
    response only, and are not carried over to the next)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    calls = _known_calls(history)
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for index, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": _text(item.content)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
                reasoning = None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"] = reasoning
                    reasoning = None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise ApiError(
                    400,
                    f"No function call with call_id {quoted(item.call_id)!r} precedes this "
                    "function_call_output.",
                    param=f"input.{index}.call_id",
                )
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _plain_text(item.output)}
            )
        else:
            reasoning = "".join(part.text for part in item.summary)
    return messages


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise ApiError(
        400,
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}.',
        param="tool_choice",
    )


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    form = body.text.format if body.text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.schema_ is None:
        raise ApiError(400, "a json_schema format needs a schema.", param="text.format.schema")
    schema = {"name": form.name or "response", "schema": form.schema_, "strict": form.strict}
    if form.description is not None:
        schema["description"] = form.description
    return {"type": "json_schema", "json_schema": schema}


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat body that runs for a Responses body whose conversation is `messages`."""
    if not messages:
        raise ApiError(400, "input is required (or a previous_response_id).", param="input")
    if body.instructions is not None:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    forwarded = body.model_dump(include=set(_FORWARDED & body.model_fields_set), by_alias=True)
    chat = {
        **forwarded,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "tools": [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
        if body.tools
        else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
    }
    try:
        return _ResponsesChat.model_validate(chat)
    except ValidationError as exc:
        info = validation_error_info(exc.errors(), "application/json")
        raise ApiError(400, info.message, param=info.param) from exc


def response_template(
    state: RenderState, body: ResponsesRequest, response_id: str, created: int
) -> ResponseObject:
    text_format = body.text.format if body.text is not None else None
    reasoning = body.reasoning
    return ResponseObject(
        id=response_id,
        created_at=created,
        status="in_progress",
        model=state.served_name(body.model),
        instructions=body.instructions,
        tools=[tool.model_dump() for tool in body.tools or ()],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature,
        top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id,
        text={
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format is not None
            else {"type": "text"}
        },
        reasoning=None if reasoning is None else {"effort": None, "summary": reasoning.summary},
        metadata=body.metadata or {},
        store=body.store,
        user=body.user,
    )


def output_messages(response: ResponseObject) -> list[dict[str, Any]]:
    """A response's output as the assistant message the next turn's template sees."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts: list[str] = []
    for item in response.output:
        if isinstance(item, ReasoningOut):
            message["reasoning_content"] = "".join(part.text for part in item.summary)
        elif isinstance(item, OutputMessage):
            texts += [part.text for part in item.content]
        elif isinstance(item, FunctionCallOut):
            call = {"name": item.name, "arguments": item.arguments}
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
    if texts or "tool_calls" not in message:
        message["content"] = "".join(texts)
    return [message]
