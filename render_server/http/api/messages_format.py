"""The Messages API's answer: a choice's text as Anthropic content blocks, streamed as
named SSE events or folded into one `Message`.

The chat path's `ChoiceProcessor` splits the text (reasoning, answer, tool calls) exactly
as /v1/chat/completions does; `BlockWriter` turns its pieces into blocks. The whole
`Message` is the streamed pieces written by the same writer, so both always agree.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Literal

import msgspec

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.http.errors import anthropic_error
from render_server.http.formatter import ResponseFormatter
from render_server.parsing.chat_output import ChoicePiece, ChoiceProcessor
from render_server.schemas.errors import ApiError
from render_server.schemas.messages_api import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaBody,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from render_server.schemas.responses import ToolCallDeltaOut

_encode = msgspec.json.Encoder().encode
_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_use_id() -> str:
    """An id as Anthropic's look: the client sends it back with the tool's result."""
    return "toolu_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _tool_input(arguments: str | None) -> dict[str, Any]:
    """A call's arguments as the object `input` must be. The parsers hand over only
    well-formed calls; arguments that are JSON but no object are kept under `value`
    rather than lost."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class BlockWriter:
    """One choice's content blocks, built piece by piece, with the events that build them.

    Answer text that is only whitespace is held until more text shows it is part of an
    answer: a tool-call parser leaves the newlines around a call as content, which would
    otherwise open empty-looking text blocks (the chat path drops such content too)."""

    def __init__(self) -> None:
        self.blocks: list[ContentBlock] = []
        self._open: Literal["text", "thinking"] | None = None
        self._held = ""

    def add(self, piece: ChoicePiece) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if piece.reasoning:
            self._extend("thinking", piece.reasoning, events)
        if piece.content:
            text = self._held + piece.content
            if self._open != "text" and not text.strip():
                self._held = text
            else:
                self._held = ""
                self._extend("text", text, events)
        for call in piece.tool_calls:
            self._tool_use(call, events)
        return events

    def finish(self, called_tools: bool) -> list[StreamEvent]:
        """Close the last block; held whitespace is the answer only when nothing was
        called."""
        events: list[StreamEvent] = []
        if self._held and not called_tools:
            self._extend("text", self._held, events)
        self._held = ""
        self._close(events)
        return events

    def _close(self, events: list[StreamEvent]) -> None:
        if self._open is not None:
            events.append(ContentBlockStop(len(self.blocks) - 1))
            self._open = None

    def _extend(
        self, kind: Literal["text", "thinking"], text: str, events: list[StreamEvent]
    ) -> None:
        if self._open != kind:
            self._close(events)
            empty: ContentBlock = TextBlock("") if kind == "text" else ThinkingBlock("")
            events.append(ContentBlockStart(len(self.blocks), empty))
            self.blocks.append(TextBlock("") if kind == "text" else ThinkingBlock(""))
            self._open = kind
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if isinstance(block, TextBlock):
            block.text += text
            events.append(ContentBlockDelta(index, TextDelta(text)))
        elif isinstance(block, ThinkingBlock):
            block.thinking += text
            events.append(ContentBlockDelta(index, ThinkingDelta(text)))

    def _tool_use(self, call: ToolCallDeltaOut, events: list[StreamEvent]) -> None:
        # Calls come whole (chat_output): one start, one delta with all the JSON, one stop.
        self._close(events)
        function = call.function
        name = (function.name if function is not None else None) or ""
        arguments = _tool_input(function.arguments if function is not None else None)
        block = ToolUseBlock(new_tool_use_id(), name, arguments)
        index = len(self.blocks)
        self.blocks.append(block)
        events.append(ContentBlockStart(index, ToolUseBlock(block.id, name, {})))
        events.append(ContentBlockDelta(index, InputJsonDelta(json.dumps(arguments))))
        events.append(ContentBlockStop(index))


def stop_reason(choice: Choice, called_tools: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished choice."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):  # a stop string matched (ids are ints)
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def message_usage(generation: Generation) -> MessageUsage:
    counts = generation.usage()
    return MessageUsage(
        input_tokens=counts.prompt_tokens - counts.cached_tokens,
        output_tokens=counts.completion_tokens,
        cache_read_input_tokens=counts.cached_tokens,
    )


def sse(event: StreamEvent) -> bytes:
    """One named event: Anthropic's clients dispatch on the `event:` line."""
    name: str = type(event).__struct_config__.tag  # type: ignore[assignment]
    return b"event: " + name.encode() + b"\ndata: " + _encode(event) + b"\n\n"


class MessagesFormatter(ResponseFormatter):
    """Anthropic's Messages answer for one choice (the API has no `n`)."""

    done_event = b""

    def __init__(self, model: str, processor: ChoiceProcessor) -> None:
        self.model = model
        self.processor = processor
        self.writer = BlockWriter()

    def _message(self, generation: Generation, content: list[ContentBlock]) -> Message:
        [choice] = generation.choices
        reason, sequence = stop_reason(choice, self.processor.called_tools)
        return Message(
            generation.request_id, self.model, content, reason, sequence, message_usage(generation)
        )

    def opening(self, generation: Generation) -> bytes:
        # Cache hits are known once the worker answered: message_delta carries them.
        prompt_tokens = len(generation.prompts[0].prompt_token_ids)
        start = Message(
            generation.request_id, self.model, [], None, None, MessageUsage(prompt_tokens, 0)
        )
        return sse(MessageStart(start)) + sse(Ping())

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        processor = self.processor
        finished = delta.finish_reason is not None
        piece = processor.feed_last(delta.text) if finished else processor.feed(delta.text)
        events = self.writer.add(piece)
        if finished:
            events += self.writer.finish(processor.called_tools)
        return b"".join(map(sse, events)) or None

    def closing(self, generation: Generation) -> bytes:
        [choice] = generation.choices
        reason, sequence = stop_reason(choice, self.processor.called_tools)
        delta = MessageDelta(MessageDeltaBody(reason, sequence), message_usage(generation))
        return sse(delta) + sse(MessageStop())

    def body(self, generation: Generation) -> msgspec.Struct:
        [choice] = generation.choices
        self.writer.add(self.processor.feed_last(choice.text))
        self.writer.finish(self.processor.called_tools)
        return self._message(generation, self.writer.blocks)

    def error_event(self, error: ApiError) -> bytes:
        data = json.dumps(anthropic_error(error.status_code, error.info.message))
        return b"event: error\ndata: " + data.encode() + b"\n\n"
