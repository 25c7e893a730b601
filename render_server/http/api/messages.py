"""Anthropic's Messages API: POST /v1/messages, /v1/messages/count_tokens and
/v1/messages/render.

A Messages body is translated into a chat body (`to_chat`) and runs the chat path:
`prepare_chat` (template, tools, tool_choice constraint, reasoning), `admit`,
`new_generation` and `respond`, with `MessagesFormatter` writing Anthropic's answer. So a
conversation generates the same tokens through either API, and nothing changes on the
wire or in the workers. Errors on these routes take Anthropic's shape (http/errors.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from render_server.http.api.chat import prepare_chat
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.api.messages_format import MessagesFormatter
from render_server.http.api.render import generate_request
from render_server.http.endpoint import admit, check_request, new_generation, prompt_specs, respond
from render_server.http.errors import validation_error_info
from render_server.parsing.chat_output import ChoiceProcessor
from render_server.parsing.tool_choice import ToolPlan
from render_server.schemas.errors import ApiError
from render_server.schemas.generate_api import GenerateRequest
from render_server.schemas.generation import ChatCompletionRequest
from render_server.schemas.messages_api import (
    CountTokensRequest,
    CountTokensResponse,
    MessageParam,
    MessagesErrorResponse,
    MessagesRequest,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)

router = APIRouter(tags=["messages"])

_encode = msgspec.json.Encoder().encode

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": MessagesErrorResponse, "description": "Invalid request"},
    404: {"model": MessagesErrorResponse, "description": "Unknown model"},
}
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    503: {"model": MessagesErrorResponse, "description": "No worker available"},
}


def _misplaced(index: int, position: int, kind: str, role: str) -> ApiError:
    return ApiError(
        400,
        f"messages.{index}.content.{position}: {kind} blocks cannot appear in a {role} turn.",
        param=f"messages.{index}.content.{position}",
    )


def _user_turn(index: int, message: MessageParam) -> list[dict[str, Any]]:
    """A user turn as chat messages: each `tool_result` a `tool` message (templates render
    tool answers from those), the text around them user messages, in their order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    turns: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlockParam):
            if parts:
                turns.append({"role": "user", "content": parts})
                parts = []
            # A chat template has no notion of a failed call: the model reads it here.
            text = f"Error: {block.text()}" if block.is_error else block.text()
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif not isinstance(block, RedactedThinkingBlockParam):
            raise _misplaced(index, position, block.type, "user")
    if parts or not turns:
        turns.append({"role": "user", "content": parts})
    return turns


def _assistant_turn(index: int, message: MessageParam) -> dict[str, Any]:
    """An assistant turn as one chat message: text, tool calls and the reasoning passed
    back (as `reasoning_content`, which templates that show past reasoning read)."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlockParam):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlockParam):
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, RedactedThinkingBlockParam):
            raise _misplaced(index, position, block.type, "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    return turn


def _tool_choice(body: CountTokensRequest) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as chat's tool_choice and parallel_tool_calls."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    if isinstance(choice, ToolChoiceNone):
        return "none", None
    parallel = False if choice.disable_parallel_tool_use else None
    if isinstance(choice, ToolChoiceAuto):
        return "auto", parallel
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    assert isinstance(choice, ToolChoiceTool)
    return {"type": "function", "function": {"name": choice.name}}, parallel


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat body's fields for a Messages body (see `to_chat`)."""
    messages: list[dict[str, Any]] = []
    system = body.system
    if system is not None:
        text = system if isinstance(system, str) else "\n".join(block.text for block in system)
        messages.append({"role": "system", "content": text})
    for index, message in enumerate(body.messages):
        if message.role == "user":
            messages += _user_turn(index, message)
        else:
            messages.append(_assistant_turn(index, message))
    # A last assistant turn is Anthropic's prefill: the answer continues it.
    prefill = body.messages[-1].role == "assistant"
    tool_choice, parallel = _tool_choice(body)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    output = body.output_config
    if output is not None and output.format is not None:
        schema = {"name": "output", "schema": output.format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
            "user": body.metadata.user_id if body.metadata is not None else None,
        }
    return fields


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat body a Messages body means (a 400 for what chat refuses in it)."""
    try:
        return ChatCompletionRequest.model_validate(chat_fields(body))
    except ValidationError as exc:
        # The Messages schema checks what the client could get wrong; this is a backstop.
        info = validation_error_info(exc.errors(), "application/json")
        raise ApiError(400, info.message) from exc


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


@router.post("/v1/messages", responses=GENERATION_ERRORS)
async def create_message(body: MessagesRequest, request: Request, state: StateDep) -> Response:
    """Anthropic's Messages API, streamed (named SSE events) or not."""
    chat = to_chat(body)
    pool = admit(state, chat)
    prompt = await prepare_chat(request, state, chat)
    generation = new_generation(
        state,
        pool,
        chat,
        message_id(),
        [prompt.prompt_ids],
        prompt_param="messages",
        constraint=prompt.constraint,
    )
    formatter = messages_formatter(
        state, state.served_name(chat.model), prompt.plan, prompt.thinking
    )
    return await respond(request, generation, formatter, stream=chat.stream)


def messages_formatter(
    state: RenderState, model: str, plan: ToolPlan, thinking: bool
) -> MessagesFormatter:
    """The Messages answer's formatter; `model` is the name it reports."""
    processor = ChoiceProcessor(plan, state.settings.reasoning_parser, enable_thinking=thinking)
    return MessagesFormatter(model, processor)


@router.post("/v1/messages/count_tokens", responses=ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request, state: StateDep) -> Response:
    """The prompt's length in tokens, tools and system included, as it would be sent."""
    chat = to_chat(body)
    check_request(state, chat)
    prompt = await prepare_chat(request, state, chat)
    return Response(
        _encode(CountTokensResponse(len(prompt.prompt_ids))), media_type="application/json"
    )


@router.post("/v1/messages/render", responses={200: {"model": GenerateRequest}, **ERRORS})
async def render_message(body: MessagesRequest, request: Request, state: StateDep) -> Response:
    """The GenerateRequest /v1/messages would run for this body, as
    /v1/chat/completions/render answers for a chat body."""
    chat = to_chat(body)
    check_request(state, chat)
    prompt = await prepare_chat(request, state, chat)
    [spec] = prompt_specs(state, chat, [prompt.prompt_ids], prompt_param="messages")
    rendered = generate_request(state, chat, message_id(), spec, prompt.constraint)
    return Response(_encode(rendered), media_type="application/json")
