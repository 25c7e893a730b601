"""Anthropic's Messages API: request bodies (pydantic) and answers (msgspec Structs).

Requests take what the API documents: `system`, `messages` with string or block content
(`text`, `tool_use`, `tool_result`, `thinking` passed back), `tools`, `tool_choice`,
`thinking`, sampling, `stop_sequences`. Unknown top-level keys are ignored, as the chat
schemas do (clients send newer fields), but a content block of an unknown type is a 400
naming it: silently dropping part of a conversation would change the answer. Image and
document blocks are refused: the served models read text only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from render_server.schemas.body import JsonBody
from render_server.schemas.generation import (
    MAX_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)

# --- request ----------------------------------------------------------------------------


class _Block(BaseModel):
    # `cache_control` and `citations` ride on many blocks: accepted, meaningless here.
    model_config = ConfigDict(extra="ignore")


class TextBlockParam(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(_Block):
    """A tool call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ThinkingBlockParam(_Block):
    """The assistant's reasoning of an earlier turn, passed back."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_Block):
    """Reasoning another server encrypted: nothing here can read it, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str | None = None


class _UnsupportedBlockParam(_Block):
    """A block known to the API that the served models cannot read: refused clearly."""

    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: str) -> str:
        raise ValueError(f"{kind} content blocks are not supported: this server reads text only.")


class ImageBlockParam(_UnsupportedBlockParam):
    pass


class DocumentBlockParam(_UnsupportedBlockParam):
    pass


def _block_type(value: Any) -> str | None:
    """The tag of a `type`-discriminated union. Tags are `<type>`: http/errors.py drops
    such location steps, so an error names the client's field (`messages.0.content.1`)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"<{kind}>" if isinstance(kind, str) else None


def _by_type(kinds: str) -> Discriminator:
    return Discriminator(
        _block_type,
        custom_error_type="invalid_type",
        custom_error_message=f"Input should be an object whose `type` is one of {kinds}",
    )


def _text_or_blocks(value: Any) -> str | None:
    if isinstance(value, str):
        return "<text>"
    return "<blocks>" if isinstance(value, list) else None


ToolResultContent = Annotated[
    Annotated[str, Tag("<text>")]
    | Annotated[
        list[
            Annotated[
                Annotated[TextBlockParam, Tag("<text>")]
                | Annotated[ImageBlockParam, Tag("<image>")]
                | Annotated[DocumentBlockParam, Tag("<document>")],
                _by_type("text, image, document"),
            ]
        ],
        Tag("<blocks>"),
    ],
    Discriminator(
        _text_or_blocks,
        custom_error_type="invalid_content",
        custom_error_message="Input should be a string or a list of text blocks",
    ),
]


class ToolResultBlockParam(_Block):
    """A tool's answer to an assistant's `tool_use`, in the next user turn."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: ToolResultContent | None = None
    is_error: bool = False

    def text(self) -> str:
        content = self.content
        if content is None or isinstance(content, str):
            return content or ""
        return "\n".join(block.text for block in content if isinstance(block, TextBlockParam))


ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("<text>")]
    | Annotated[ToolUseBlockParam, Tag("<tool_use>")]
    | Annotated[ToolResultBlockParam, Tag("<tool_result>")]
    | Annotated[ThinkingBlockParam, Tag("<thinking>")]
    | Annotated[RedactedThinkingBlockParam, Tag("<redacted_thinking>")]
    | Annotated[ImageBlockParam, Tag("<image>")]
    | Annotated[DocumentBlockParam, Tag("<document>")],
    _by_type("text, tool_use, tool_result, thinking, redacted_thinking"),
]


# The tags show in validation error locations; http/errors.py drops `<...>` parts, so a
# bad block is reported as `messages.0.content.1`.
MessageContentParam = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[ContentBlockParam], Tag("<blocks>")],
    Discriminator(
        _text_or_blocks,
        custom_error_type="invalid_content",
        custom_error_message="Input should be a string or a list of content blocks",
    ),
]

SystemParam = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[TextBlockParam], Tag("<blocks>")],
    Discriminator(
        _text_or_blocks,
        custom_error_type="invalid_content",
        custom_error_message="Input should be a string or a list of text blocks",
    ),
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: MessageContentParam


class ToolParam(BaseModel):
    """A client tool. Anthropic's server tools (web search, code execution...) carry a
    versioned `type` and run on Anthropic's side: refused."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceAuto(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["none"]


ToolChoiceParam = Annotated[
    Annotated[ToolChoiceAuto, Tag("<auto>")]
    | Annotated[ToolChoiceAny, Tag("<any>")]
    | Annotated[ToolChoiceTool, Tag("<tool>")]
    | Annotated[ToolChoiceNone, Tag("<none>")],
    _by_type("auto, any, tool, none"),
]


class ThinkingEnabled(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    """Required as the API requires it; the template's thinking switch is all it turns on
    (the model's reasoning is bounded by max_tokens, as a whole)."""


class ThinkingAdaptive(BaseModel):
    """The model decides whether to think: for a template's switch, thinking is on."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["adaptive"]


class ThinkingDisabled(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["disabled"]


ThinkingParam = Annotated[
    Annotated[ThinkingEnabled, Tag("<enabled>")]
    | Annotated[ThinkingAdaptive, Tag("<adaptive>")]
    | Annotated[ThinkingDisabled, Tag("<disabled>")],
    _by_type("enabled, adaptive, disabled"),
]


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs: the answer's text is JSON of `format.schema` (`effort` is a
    hint for Anthropic's models, ignored)."""

    model_config = ConfigDict(extra="ignore")

    format: JsonOutputFormat | None = None
    effort: str | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(JsonBody):
    """POST /v1/messages/count_tokens: what decides the prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: SystemParam | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (and its render)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, stops: list[str] | None) -> list[str] | None:
        if any(not 0 < len(stop) <= MAX_STOP_STRING_CHARS for stop in stops or []):
            raise ValueError(
                f"each stop sequence must have 1 to {MAX_STOP_STRING_CHARS} characters."
            )
        return stops


class ErrorDetail(BaseModel):
    type: str
    message: str


class MessagesErrorResponse(BaseModel):
    """Every error of the /v1/messages routes (for the OpenAPI document)."""

    type: Literal["error"] = "error"
    error: ErrorDetail


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


# --- answer -----------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""
    """Anthropic signs its reasoning so it can be passed back unaltered; nothing here
    checks one, so it is empty."""


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(msgspec.Struct):
    """Anthropic's usage: the prompt's tokens are input_tokens plus those read from the
    prefix cache (nothing is written to a cache on request, so no creation)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    role: Literal["assistant"] = "assistant"


# Streamed events: each is sent as `event: <type>` and `data: <the struct>`.


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDeltaBody(msgspec.Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: MessageDeltaBody
    usage: MessageUsage
    """Totals, which the SDKs let overwrite message_start's (the cache hits are known
    only once the worker answered)."""


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


StreamEvent = (
    MessageStart
    | Ping
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
)
