"""Response bodies of chat and completions, exactly in OpenAI's shape.

These are msgspec Structs rather than pydantic models: a streamed response encodes one
chunk per token per choice, and msgspec encodes a chunk in about a microsecond, which is
what lets one render process stream tens of thousands of tokens per second. Request
bodies stay pydantic, where validation errors must name the field.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class FunctionOut(msgspec.Struct):
    """The function a tool call invokes, with its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    """One tool call in an assistant message."""

    id: str
    function: FunctionOut
    type: str = "function"


class FunctionDeltaOut(msgspec.Struct, omit_defaults=True):
    """A streamed piece of a tool call's function: the name once, then arguments text."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, omit_defaults=True):
    """A streamed piece of tool call `index`: id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDeltaOut | None = None


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    """The assistant's reply (`role` and `content` are always present; `content` is null
    when only tools were called); fields at their defaults are left out."""

    role: str
    content: str | None
    tool_calls: list[ToolCallOut] = []
    reasoning_content: str | None = None
    """The model's reasoning, split off by the --reasoning-parser."""
    reasoning: str | None = None
    """Alias of reasoning_content, as some clients read it."""


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob: one token at one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt position (None for the first) the prompt's own
token and the top alternatives, by token id."""


class ChatChoice(msgspec.Struct):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    token_ids: list[int] | None = None
    """vLLM's `return_token_ids`: the generated ids."""


class ChatCompletion(msgspec.Struct):
    """The body of a non-streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chunk adds to a chat choice; absent keys are left out."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice's part of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class ChatChunkChoiceWithIds(ChatChunkChoice, kw_only=True):
    """A chunk's choice under `return_token_ids`: the ids this chunk adds."""

    token_ids: list[int]


class ChatCompletionChunk(msgspec.Struct):
    """One `data:` event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatCompletionFirstChunk(ChatCompletionChunk, kw_only=True):
    """The first chunk under `return_token_ids`: it carries the prompt's ids."""

    prompt_token_ids: list[int]


class CompletionLogprobs(msgspec.Struct):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One choice of a streamed text completion's chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class CompletionChoiceWithIds(CompletionChoice, kw_only=True):
    """A chunk's choice under `return_token_ids`: the ids it adds, and the prompt's ids
    in the choice's first chunk."""

    token_ids: list[int]
    prompt_token_ids: list[int] | None = None


class CompletionBodyChoice(CompletionChoice, kw_only=True):
    """One choice of a non-streamed text completion, with vLLM's fields (null unless
    asked for)."""

    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class TextCompletion(msgspec.Struct):
    """The body of a text completion, streamed or not."""

    id: str
    created: int
    model: str
    choices: Sequence[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None
