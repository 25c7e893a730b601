"""A stored response's input items, as GET /v1/responses/{id}/input_items lists them.

When a response is created its request's `input` is kept beside it in the store, each
item in the shape OpenAI returns it (a message with its content parts, a function call or
its output, reasoning), with the id the client gave it or a new one. Listing pages through
them as OpenAI's cursor lists do: `order` desc (the default, last input first) or asc,
`after` / `before` an item id of that order, `limit` 1-100 (default 20), and `has_more`
when items are left past the page.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from render_server.http.api.responses_input import HARMLESS_INCLUDES, check_include
from render_server.http.api.responses_stream import new_item_id
from render_server.schemas.errors import ApiError, quoted
from render_server.schemas.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemContent,
    MessageItem,
    ResponsesRequest,
    StoredResponse,
)

INCLUDABLE = HARMLESS_INCLUDES | {"reasoning.encrypted_content", "message.output_text.logprobs"}
"""OpenAI's `include` values: accepted, as input items here hold nothing they would add."""


class InputItemList(msgspec.Struct):
    """OpenAI's list of a response's input items."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


def _parts(content: ItemContent, kind: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    return [
        {"type": "refusal", "refusal": part.refusal}
        if part.type == "refusal"
        else {"type": "input_text" if part.type == "text" else part.type, "text": part.text}
        for part in content
    ]


def _message(item: MessageItem) -> dict[str, Any]:
    if item.role == "assistant":
        content = [
            {**part, "annotations": []} if part["type"] == "output_text" else part
            for part in _parts(item.content, "output_text")
        ]
    else:
        content = _parts(item.content, "input_text")
    return {
        "id": item.id or new_item_id("msg"),
        "type": "message",
        "role": item.role,
        "status": "completed",
        "content": content,
    }


def context_items(previous: StoredResponse | None, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The items a response is generated from, as OpenAI lists them, oldest first: with a
    `previous_response_id`, the earlier turns' input and output items, then this input."""
    earlier: list[dict[str, Any]] = []
    if previous is not None:
        earlier = [*previous.input_items, *msgspec.to_builtins(previous.response.output)]
    return [*earlier, *input_items(body)]


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it, oldest first (instructions are not an item)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [_message(MessageItem(role="user", content=body.input))]
    items: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            items.append(_message(item))
        elif isinstance(item, FunctionCallItem):
            items.append(
                {
                    "id": item.id or new_item_id("fc"),
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            items.append(
                {
                    "id": item.id or new_item_id("fco"),
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": output if isinstance(output, str) else _parts(output, "input_text"),
                    "status": "completed",
                }
            )
        else:
            items.append(
                {
                    "id": item.id or new_item_id("rs"),
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": p.text} for p in item.summary],
                }
            )
    return items


def _position(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    for index, item in enumerate(items):
        if item["id"] == item_id:
            return index
    raise ApiError(400, f"No input item with id {quoted(item_id)!r} in this response.", param=param)


def page(
    items: list[dict[str, Any]],
    *,
    order: Literal["asc", "desc"],
    limit: int,
    after: str | None,
    before: str | None,
    include: list[str],
) -> InputItemList:
    """One page of `items` (oldest first, as stored)."""
    check_include(include, INCLUDABLE)
    ordered = items if order == "asc" else items[::-1]
    start, end = 0, len(ordered)
    if after is not None:
        start = _position(ordered, after, "after") + 1
    if before is not None:
        end = _position(ordered, before, "before")
    window = ordered[start:end]
    # Paging back from `before` alone, the page is the items nearest to it.
    data = window[-limit:] if before is not None and after is None else window[:limit]
    return InputItemList(
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=len(window) > limit,
    )
