"""The OpenAI Responses API's bodies: the request (pydantic) and the response object,
its output items and the stored record (msgspec).

Not to be confused with `schemas/responses.py`, which holds the chat and completions
output shapes. The request derives from `SamplingFields`, so every sampling extra the
chat endpoint accepts is accepted here too and handed on unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from render_server.schemas.errors import quoted
from render_server.schemas.generation import MAX_MESSAGES, SamplingFields

MAX_INPUT_ITEMS = MAX_MESSAGES
"""Most items an `input` list may hold (the chat endpoint's message bound)."""
MAX_ID_CHARS = 128
MAX_METADATA_KEYS = 16

UNSUPPORTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer_use_preview",
        "computer",
        "mcp",
        "code_interpreter",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
    }
)
"""Hosted and non-function tools: this server runs none of them."""

_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_PART_TYPES = frozenset({"input_text", "output_text", "text", "refusal"})


class _Item(BaseModel):
    # Items a client passes back from an earlier output carry fields that only describe
    # them (id, status, annotations, logprobs): ignored, as they change nothing.
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Item):
    """A text part of a message: input_text, output_text, or a refusal."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str = ""

    @property
    def as_text(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


def _text_or(other: str) -> Any:
    """Discriminator of `str | list` unions: tags keep error paths the client's own
    (`input.0.content`), where pydantic would name the member it tried."""

    def kind(value: Any) -> str | None:
        if isinstance(value, str):
            return "<text>"
        return other if isinstance(value, list) else None

    return kind


ItemContent = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[ContentPart], Tag("<parts>")],
    Discriminator(
        _text_or("<parts>"),
        custom_error_type="invalid_content",
        custom_error_message="Input should be a string or a list of content parts",
    ),
]


class _InputItem(_Item):
    id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    """Kept for the item's listing (GET /v1/responses/{id}/input_items); else one is made."""


class MessageItem(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: ItemContent


class FunctionCallItem(_InputItem):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_InputItem):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: ItemContent


class SummaryPart(_Item):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningItem(_InputItem):
    """Reasoning passed back: its summary is the reasoning the next turn's template sees."""

    type: Literal["reasoning"]
    summary: list[SummaryPart] = Field(default_factory=list)
    encrypted_content: None = None
    """Never produced here: one sent back is refused (it cannot be decrypted)."""


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
        return f"<{kind}>" if kind in _ITEM_TYPES else None
    return None


# The tags appear in validation error locations, where `<...>` parts are dropped.
InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="Input should be an input item object",
    ),
]


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: str | None = None
    """Accepted for compatibility: a model answers at its own length."""


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: str | None = None
    """Refused when set: the chat templates here take no effort."""
    summary: str | None = None
    """Accepted: with a --reasoning-parser the parsed reasoning is the summary."""


def _field_error(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_field", message, {"param": param})


def _check_content(content: Any, param: str) -> None:
    if not isinstance(content, list):
        return
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in _PART_TYPES:
            raise _field_error(
                f"{param}.{index}.type",
                f"content part type {quoted(kind)!r} is not supported: only text parts "
                "(input_text, output_text, refusal) are.",
            )


def _check_items(items: list[Any]) -> None:
    if len(items) > MAX_INPUT_ITEMS:
        raise _field_error("input", f"at most {MAX_INPUT_ITEMS} input items, not {len(items)}.")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # the item's own validation says what it should be
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise _field_error(f"input.{index}.type", "an input item needs a type.")
        if kind not in _ITEM_TYPES:
            raise _field_error(
                f"input.{index}.type",
                f"input item type {quoted(str(kind))!r} is not supported: use message, "
                "function_call, function_call_output or reasoning.",
            )
        if kind == "message":
            _check_content(item.get("content"), f"input.{index}.content")
        if kind == "function_call_output":
            _check_content(item.get("output"), f"input.{index}.output")


def _check_tools(tools: list[Any]) -> None:
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            reason = "is not available on this server" if kind in UNSUPPORTED_TOOLS else "unknown"
            raise _field_error(
                f"tools.{index}.type",
                f"tool type {quoted(kind)!r} {reason}: only function tools are supported.",
            )


class ResponsesRequest(SamplingFields):
    """POST /v1/responses: OpenAI's Responses fields, plus the chat endpoint's sampling
    extras (top_k, min_p, penalties, stop, ignore_eos, structured_outputs, ...)."""

    input: (
        Annotated[
            Annotated[str, Tag("<text>")]
            | Annotated[list[InputItem], Tag("<items>"), Field(max_length=MAX_INPUT_ITEMS)],
            Discriminator(
                _text_or("<items>"),
                custom_error_type="invalid_input",
                custom_error_message="Input should be a string or a list of input items",
            ),
        ]
        | None
    ) = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """"auto", "required", "none", or {"type": "function", "name": ...}."""
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: ReasoningConfig | None = None
    # Declared to be refused when set: stored prompts and conversations live elsewhere,
    # and per-token logprobs are not part of this API here.
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _check_kinds(cls, data: Any) -> Any:
        # Before the union is tried: its errors could not name an unknown type.
        if isinstance(data, dict):
            if isinstance(items := data.get("input"), list):
                _check_items(items)
            if isinstance(tools := data.get("tools"), list):
                _check_tools(tools)
        return data


# ---- The response object (msgspec: encoded per request, and stored) --------------------

ResponseStatus = Literal["completed", "incomplete", "cancelled", "failed", "in_progress"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOut(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class SummaryText(msgspec.Struct, kw_only=True, tag_field="type", tag="summary_text"):
    text: str


class ReasoningOut(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[SummaryText]
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(msgspec.Struct):
    code: Literal["server_error", "invalid_prompt"]
    """One of the codes the API defines (the `error` event carries the server's own)."""
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """OpenAI's `Response`, with every field its SDK model reads."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseErrorInfo | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = msgspec.field(default_factory=dict)
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    store: bool = True
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"
    user: str | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class StoredResponse(msgspec.Struct):
    """What the response store keeps per response: the object GET returns, and the
    conversation up to and including its output as chat messages, which a response
    naming it as `previous_response_id` continues, and its request's input items as
    GET /v1/responses/{id}/input_items lists them."""

    response: ResponseObject
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = msgspec.field(default_factory=list)
