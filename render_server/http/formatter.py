"""The formatter interface a generating endpoint supplies, and what OpenAI's two
completion APIs share on top of it."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import msgspec

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.http.serving import SSE_DONE, sse_error, sse_event, usage_of
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import StreamOptions
from render_server.schemas.responses import Usage

ChunkChoiceT = TypeVar("ChunkChoiceT")
ChoiceT = TypeVar("ChoiceT")


class ResponseFormatter(ABC):
    """One request's answer in one API's shape: the only part an endpoint writes.

    Streamed, the formatter turns the lifecycle into SSE bytes: `opening` before any
    delta, `delta_events` for each `ChoiceDelta` (the hot path: return None to send
    nothing, several events joined in one bytes object when one delta means several), and
    `closing` once every choice ended (usage, or a final "completed"/"message_stop" event).
    Not streamed, `body` builds the whole answer once every choice ended. The framing is
    the formatter's, so APIs with named `event:` lines fit as well as OpenAI's `data:` ones;
    `error_event` and `done_event` end a stream the API's way. One instance per request:
    a formatter may keep per-choice state (tool parsers, logprob offsets).
    """

    done_event: bytes = SSE_DONE
    """Sent last on every stream (b"" for an API without a terminator)."""

    def opening(self, generation: Generation) -> bytes:
        """Events before the first delta."""
        return b""

    @abstractmethod
    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        """The events of one choice's delta, or None."""

    def closing(self, generation: Generation) -> bytes:
        """Events after every choice finished."""
        return b""

    @abstractmethod
    def body(self, generation: Generation) -> msgspec.Struct:
        """The non-streamed answer, once every choice finished."""

    def error_event(self, error: ApiError) -> bytes:
        """An error after the 200 went out (OpenAI's shape by default)."""
        return sse_error(error)


class OpenAIFormatter(ResponseFormatter, Generic[ChunkChoiceT, ChoiceT]):
    """OpenAI's chat and text completions: an id/created/model envelope around choices,
    `data:` events ended by `[DONE]`, and a usage chunk last when the client asked for
    `stream_options.include_usage`. Subclasses build the envelopes and the choices."""

    def __init__(self, model: str, stream_options: StreamOptions | None) -> None:
        self.model = model
        self.created = int(time.time())
        self.include_usage = stream_options is not None and stream_options.include_usage

    @abstractmethod
    def chunk(
        self, generation: Generation, choices: list[ChunkChoiceT], usage: Usage | None = None
    ) -> msgspec.Struct:
        """One streamed event's body."""

    @abstractmethod
    def whole(self, generation: Generation, choices: list[ChoiceT], usage: Usage) -> msgspec.Struct:
        """The non-streamed body."""

    @abstractmethod
    def whole_choice(self, choice: Choice) -> ChoiceT:
        """One finished choice in the non-streamed body."""

    def event(self, generation: Generation, choice: ChunkChoiceT) -> bytes:
        """The SSE event of one choice's delta."""
        return sse_event(self.chunk(generation, [choice]))

    def closing(self, generation: Generation) -> bytes:
        if not self.include_usage:
            return b""
        return sse_event(self.chunk(generation, [], usage_of(generation)))

    def body(self, generation: Generation) -> msgspec.Struct:
        choices = [self.whole_choice(choice) for choice in generation.choices]
        return self.whole(generation, choices, usage_of(generation))
