"""Request and response bodies of /tokenize and /detokenize (the shape vLLM serves).

/tokenize takes one of two forms: the prompt form (`prompt`) and the chat form
(`messages`, rendered through the chat template first). A body with `messages` is the
chat form; anything else is read as the prompt form, so a body with neither reports
`prompt` as the missing field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from render_server.schemas.body import JsonBody


class _StrictBody(BaseModel):
    # Unknown fields are a client bug (a typo in `add_generation_prompt` would otherwise be
    # silently ignored), so they are rejected, as the OpenAI API does.
    model_config = ConfigDict(extra="forbid")


class TextContentPart(_StrictBody):
    """One text part of a message's content list."""

    type: Literal["text"]
    text: str


def _text_or(other: str) -> Any:
    """Discriminator of `str | <other>` unions: tags instead of pydantic's member names
    keep validation error paths clean (`messages.0.content`, not `...content.str`)."""

    def kind(value: Any) -> str | None:
        if isinstance(value, str):
            return "<text>"
        return other if isinstance(value, list | dict) else None

    return kind


MessageContent = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[TextContentPart], Tag("<parts>")],
    Discriminator(
        _text_or("<parts>"),
        custom_error_type="invalid_content",
        custom_error_message="Input should be a string or a list of content parts",
    ),
]

FunctionArguments = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[dict[str, Any], Tag("<object>")],
    Discriminator(
        _text_or("<object>"),
        custom_error_type="invalid_arguments",
        custom_error_message="Input should be a JSON string or an object",
    ),
]


class FunctionCall(_StrictBody):
    """The function an assistant message called."""

    name: str
    arguments: FunctionArguments
    """JSON text as the OpenAI API sends it, or an already-decoded object."""


class ToolCall(_StrictBody):
    """A tool call inside an assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message as the OpenAI API defines it.

    Extra keys are kept and handed to the chat template: some templates read fields the
    OpenAI schema does not have (e.g. `reasoning_content`).
    """

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1, max_length=64)
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: only the keys the client sent (as
        vLLM passes them), but tool calls complete with their defaults (`type`)."""
        data = self.model_dump(exclude_unset=True)
        if self.tool_calls is not None:
            data["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return data


class FunctionDefinition(_StrictBody):
    """A function the model may call."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool | None = None


class ToolDefinition(_StrictBody):
    """A tool offered to the model (only functions exist today)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class TokenizePromptRequest(JsonBody, _StrictBody):
    """Tokenize a plain string."""

    model: str | None = None
    """Must name the served model when given."""
    prompt: str
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (e.g. BOS)."""
    return_token_strs: bool = False
    """Also return each token's string form."""


class TokenizeChatRequest(JsonBody, _StrictBody):
    """Render messages through the chat template, then tokenize the result."""

    model: str | None = None
    """Must name the served model when given."""
    messages: list[ChatMessage] = Field(max_length=4096)
    add_generation_prompt: bool = True
    """End with the header that starts the assistant's turn."""
    continue_final_message: bool = False
    """Leave the last message open so the model continues it."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens too (the template usually has them already)."""
    tools: list[ToolDefinition] | None = None
    chat_template: str | None = None
    """A template for this request; only honoured with --trust-request-chat-template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the template; internal ones cannot be overridden."""
    return_token_strs: bool = False
    """Also return each token's string form."""

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True; set `add_generation_prompt` to false to continue the final message."
            )
        return self


def _tokenize_form(body: Any) -> str:
    return "<chat>" if isinstance(body, dict) and "messages" in body else "<prompt>"


# The tags appear in validation error locations; errors.py drops `<...>` parts so the
# reported `param` is the client's own field path (e.g. `messages.0.role`).
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("<chat>")]
    | Annotated[TokenizePromptRequest, Tag("<prompt>")],
    Discriminator(_tokenize_form),
]


class TokenizeResponse(BaseModel):
    """Token ids of the prompt, with the model's context length for reference."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    """Each token's string form; null unless `return_token_strs` was set."""


class DetokenizeRequest(JsonBody, _StrictBody):
    """Turn token ids back into text."""

    model: str | None = None
    """Must name the served model when given."""
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The decoded text (special tokens included, so /tokenize output round-trips)."""

    prompt: str
