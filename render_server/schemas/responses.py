"""Response bodies of chat and completions, exactly in OpenAI's shape.

These are msgspec Structs rather than pydantic models: a streamed response encodes one
chunk per token per choice, and msgspec encodes a chunk in about a microsecond, which is
what lets one render process stream tens of thousands of tokens per second. Request
bodies stay pydantic, where validation errors must name the field.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]
StopReason = int | str | None


class PromptTokensDetails(msgspec.Struct):
    """Prompt tokens served from the worker's prefix cache."""

    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """Token counts of a whole response (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    """The sampled token at one position, with its alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(msgspec.Struct):
    """Logprobs of a chat choice's content tokens."""

    content: list[ChatTokenLogprob] | None


class ChatMessageOut(msgspec.Struct):
    """The assistant's reply."""

    content: str | None
    role: str = "assistant"
    refusal: str | None = None
    tool_calls: list[dict] = []


class ChatChoice(msgspec.Struct):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class ChatCompletion(msgspec.Struct):
    """The body of a non-streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chunk adds to a chat choice; absent keys are left out."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice's part of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(msgspec.Struct):
    """One `data:` event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(msgspec.Struct):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One choice of a text completion (also the choice shape of its stream chunks)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class TextCompletion(msgspec.Struct):
    """The body of a text completion, streamed or not."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None
