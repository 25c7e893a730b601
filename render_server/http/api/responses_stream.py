"""The Responses API's answer: output items built from a choice's parsed pieces, as
named SSE events while they stream, and as the final `Response` object.

One `ResponsesFormatter` serves both ways: streamed, each `ChoicePiece` (reasoning,
content, whole tool calls, from `ChoiceProcessor`) opens, extends and closes output items
with their events; not streamed, the whole choice is one piece through the same code, so
both answers hold the same items.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from render_server.generation.lifecycle import ChoiceDelta, Generation
from render_server.http.formatter import ResponseFormatter
from render_server.parsing.chat_output import ChoicePiece, ChoiceProcessor
from render_server.schemas.errors import ApiError
from render_server.schemas.responses import ToolCallDeltaOut
from render_server.schemas.responses_api import (
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOut,
    ResponseErrorInfo,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    SummaryText,
)
from shared.protocol import FinishReason

_encode = msgspec.json.Encoder().encode


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def named_event(kind: str, body: dict[str, Any]) -> bytes:
    """One SSE event with its `event:` line, as the Responses API streams them."""
    return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"


@dataclass
class _OpenItem:
    """The output item being written: a reasoning summary or a message's text."""

    kind: str  # "reasoning" or "message"
    id: str
    index: int
    text: list[str] = field(default_factory=list)


_FINAL_EVENTS: dict[ResponseStatus, str] = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    # The API has no event of its own for a cancelled response: it is not complete.
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


class ResponsesFormatter(ResponseFormatter):
    """A response's output items and events; `final` is the answer once it ended."""

    done_event = b""

    def __init__(
        self,
        template: ResponseObject,
        processor: ChoiceProcessor,
        count_tokens: Callable[[str], int],
    ) -> None:
        self.template = template
        """The response as it starts: id, created_at, model and the echoed request fields."""
        self.processor = processor
        self.count_tokens = count_tokens
        self.sequence = 0
        self.items: list[OutputItem] = []
        self.open: _OpenItem | None = None
        self.spaces = ""
        """Blank content not yet shown: it belongs to a message only if text follows (or
        no call does), as the chat endpoint drops blank content beside tool calls."""
        self.reasoning_text: list[str] = []
        self.final: ResponseObject | None = None
        self.cancelled = False
        """Set when the response was cancelled: its abort ends it "cancelled"."""

    # ---- events ------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(kind, body)

    def _response_event(self, kind: str, response: ResponseObject) -> bytes:
        return self._event(kind, response=msgspec.to_builtins(response))

    def opening(self, generation: Generation) -> bytes:
        return self._response_event("response.created", self.template) + self._response_event(
            "response.in_progress", self.template
        )

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        finished = delta.finish_reason is not None
        if not delta.text and not finished:
            return None
        processor = self.processor
        piece = processor.feed_last(delta.text) if finished else processor.feed(delta.text)
        events = self._add(piece)
        if finished:
            events += self._finish(delta.finish_reason)
        return events or None

    def closing(self, generation: Generation) -> bytes:
        response = self._final(generation)
        return self._response_event(_FINAL_EVENTS[response.status], response)

    def error_event(self, error: ApiError) -> bytes:
        info = error.info
        code = info.code or info.type
        events = self._event("error", code=code, message=info.message, param=info.param)
        events += self._close_open("incomplete")
        response = msgspec.structs.replace(
            self.snapshot("failed", None),
            error=ResponseErrorInfo(
                code="server_error" if error.status_code >= 500 else "invalid_prompt",
                message=info.message,
            ),
        )
        self.final = response
        return events + self._response_event("response.failed", response)

    def body(self, generation: Generation) -> msgspec.Struct:
        [choice] = generation.choices
        self._add(self.processor.feed_last(choice.text))
        self._finish(choice.finish_reason)
        return self._final(generation)

    # ---- items -------------------------------------------------------------------------

    def _add(self, piece: ChoicePiece) -> bytes:
        events = b""
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            if self.open is not None and self.open.kind == "message":
                events += self._text("message", piece.content)
            elif piece.content.strip():
                events += self._text("message", self.spaces + piece.content)
                self.spaces = ""
            else:
                self.spaces += piece.content
        for call in piece.tool_calls:
            events += self._call(call)
        return events

    def _text(self, kind: str, text: str) -> bytes:
        events = b""
        if self.open is None or self.open.kind != kind:
            events += self._close_open("completed")
            events += self._open_item(kind)
        item = self.open
        assert item is not None
        item.text.append(text)
        if kind == "reasoning":
            self.reasoning_text.append(text)
            return events + self._event(
                "response.reasoning_summary_text.delta",
                item_id=item.id, output_index=item.index, summary_index=0, delta=text,
            )  # fmt: skip
        return events + self._event(
            "response.output_text.delta",
            item_id=item.id, output_index=item.index, content_index=0, delta=text, logprobs=[],
        )  # fmt: skip

    def _open_item(self, kind: str) -> bytes:
        index = len(self.items)
        item_id = new_item_id("rs" if kind == "reasoning" else "msg")
        added: OutputItem = (
            ReasoningOut(id=item_id, summary=[], status="in_progress")
            if kind == "reasoning"
            else OutputMessage(id=item_id, status="in_progress", content=[])
        )
        self.items.append(added)
        self.open = _OpenItem(kind, item_id, index)
        events = self._event(
            "response.output_item.added", output_index=index, item=msgspec.to_builtins(added)
        )
        if kind == "reasoning":
            return events + self._event(
                "response.reasoning_summary_part.added",
                item_id=item_id, output_index=index, summary_index=0,
                part={"type": "summary_text", "text": ""},
            )  # fmt: skip
        return events + self._event(
            "response.content_part.added",
            item_id=item_id, output_index=index, content_index=0,
            part=msgspec.to_builtins(OutputText(text="")),
        )  # fmt: skip

    def _close_open(self, status: ItemStatus) -> bytes:
        current = self.open
        if current is None:
            return b""
        self.open = None
        text = "".join(current.text)
        where = {"item_id": current.id, "output_index": current.index}
        if current.kind == "reasoning":
            done: OutputItem = ReasoningOut(
                id=current.id, summary=[SummaryText(text=text)], status=status
            )
            part = {"type": "summary_text", "text": text}
            events = self._event(
                "response.reasoning_summary_text.done", **where, summary_index=0, text=text
            )
            events += self._event(
                "response.reasoning_summary_part.done", **where, summary_index=0, part=part
            )
        else:
            output = OutputText(text=text)
            done = OutputMessage(id=current.id, status=status, content=[output])
            events = self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            events += self._event(
                "response.content_part.done",
                **where, content_index=0, part=msgspec.to_builtins(output),
            )  # fmt: skip
        self.items[current.index] = done
        return events + self._event(
            "response.output_item.done", output_index=current.index, item=msgspec.to_builtins(done)
        )

    def _call(self, call: ToolCallDeltaOut) -> bytes:
        events = self._close_open("completed")
        self.spaces = ""
        function = call.function
        name = (function.name if function else None) or ""
        arguments = (function.arguments if function else None) or ""
        index = len(self.items)
        item = FunctionCallOut(
            id=new_item_id("fc"),
            call_id=call.id or new_item_id("call"),
            name=name,
            arguments="",
            status="in_progress",
        )
        self.items.append(item)
        where = {"item_id": item.id, "output_index": index}
        done = msgspec.structs.replace(item, arguments=arguments, status="completed")
        self.items[index] = done
        return (
            events
            + self._event(
                "response.output_item.added", output_index=index, item=msgspec.to_builtins(item)
            )
            + self._event("response.function_call_arguments.delta", **where, delta=arguments)
            + self._event("response.function_call_arguments.done", **where, arguments=arguments)
            + self._event(
                "response.output_item.done", output_index=index, item=msgspec.to_builtins(done)
            )
        )

    def _finish(self, reason: FinishReason | None) -> bytes:
        status = self._status(reason)
        item_status: ItemStatus = "completed" if status == "completed" else "incomplete"
        events = b""
        if self.spaces and not any(isinstance(item, FunctionCallOut) for item in self.items):
            events += self._text("message", self.spaces)
        self.spaces = ""
        return events + self._close_open(item_status)

    def _status(self, reason: FinishReason | None) -> ResponseStatus:
        if reason == "length":
            return "incomplete"
        if reason == "abort":
            return "cancelled" if self.cancelled else "incomplete"
        if reason == "error":
            return "failed"
        return "completed"

    # ---- the response ------------------------------------------------------------------

    def snapshot(self, status: ResponseStatus, usage: ResponseUsage | None) -> ResponseObject:
        return msgspec.structs.replace(
            self.template, status=status, output=list(self.items), usage=usage
        )

    def _final(self, generation: Generation) -> ResponseObject:
        [choice] = generation.choices
        status = self._status(choice.finish_reason)
        counts = generation.usage()
        reasoning = "".join(self.reasoning_text)
        reasoning_tokens = self.count_tokens(reasoning) if reasoning else 0
        usage = ResponseUsage(
            input_tokens=counts.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=counts.cached_tokens),
            output_tokens=counts.completion_tokens,
            # Counted again from the text: the worker counts tokens, not what they were.
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=min(reasoning_tokens, counts.completion_tokens)
            ),
            total_tokens=counts.prompt_tokens + counts.completion_tokens,
        )
        response = self.snapshot(status, usage)
        if status == "incomplete" and choice.finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        self.final = response
        return response
