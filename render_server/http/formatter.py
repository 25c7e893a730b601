"""The formatter interface a generating endpoint supplies, and what OpenAI's two
completion APIs share on top of it."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation, PromptGeneration
from render_server.http.serving import SSE_DONE, sse_error, sse_event, usage_of
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import SamplingFields
from render_server.schemas.responses import PromptLogprob, PromptLogprobs, Usage

if TYPE_CHECKING:
    # Only a type here: the api package imports this module while it initializes.
    from render_server.http.api.deps import RenderState

TokenLookup = Callable[[int], tuple[str, list[int]]]
"""A token id -> its text and bytes, as logprobs spell them."""

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
    `data:` events ended by `[DONE]`, a usage chunk last when the client asked for
    `stream_options.include_usage` (usage on every chunk with vLLM's
    `continuous_usage_stats`), and vLLM's token-id options. Subclasses build the
    envelopes and the choices."""

    def __init__(self, state: RenderState, body: SamplingFields) -> None:
        self.model = state.served_name(body.model)
        self.system_fingerprint = state.system_fingerprint
        self.created = int(time.time())
        options = body.stream_options
        self.include_usage = options is not None and options.wants_final_usage
        self.usage_per_chunk = options is not None and options.wants_usage_per_chunk
        self.return_token_ids = bool(body.return_token_ids)
        self.text_of: TokenLookup = state.token_text.lookup
        self.tokens_as_ids = bool(body.return_tokens_as_token_ids)
        self.lookup: TokenLookup = token_id_text if self.tokens_as_ids else self.text_of
        """How logprobs spell a token: its text, or `token_id:N`."""

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
        usage = usage_of(generation) if self.usage_per_chunk else None
        return sse_event(self.chunk(generation, [choice], usage))

    def closing(self, generation: Generation) -> bytes:
        if not self.include_usage:
            return b""
        return sse_event(self.chunk(generation, [], usage_of(generation)))

    def body(self, generation: Generation) -> msgspec.Struct:
        choices = [self.whole_choice(choice) for choice in generation.choices]
        return self.whole(generation, choices, usage_of(generation))

    def prompt_logprobs(self, prompt: PromptGeneration) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of one prompt, when the request asked for them."""
        entries = prompt.prompt_logprobs
        if entries is None:
            return None
        decoded = self.text_of
        result: PromptLogprobs = []
        for token_id, entry in zip(prompt.prompt_token_ids, entries, strict=False):
            if entry is None:
                result.append(None)
                continue
            # The prompt's own token first, then the top alternatives (ranks 1..k); a top
            # one that is the prompt's token is the same entry. -inf is not JSON: vLLM
            # sends -9999.0.
            position = {
                token_id: PromptLogprob(
                    max(entry.logprob, MIN_LOGPROB), entry.rank, decoded(token_id)[0]
                )
            }
            for rank, (alt_id, alt_logprob) in enumerate(
                zip(entry.top_token_ids, entry.top_logprobs, strict=False), start=1
            ):
                position[alt_id] = PromptLogprob(
                    max(alt_logprob, MIN_LOGPROB), rank, decoded(alt_id)[0]
                )
            result.append(position)
        return result


MIN_LOGPROB = -9999.0
"""What a logprob of -inf is sent as (-inf is not JSON), as vLLM sends it."""


def token_id_text(token_id: int) -> tuple[str, list[int]]:
    """vLLM's `return_tokens_as_token_ids` spelling of a token: `token_id:N`."""
    text = f"token_id:{token_id}"
    return text, list(text.encode())
