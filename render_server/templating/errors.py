"""Why a chat template could not render a request; the API answers each with HTTP 400."""

from __future__ import annotations


class ChatTemplateError(ValueError):
    """The chat template could not render this request; the API answers HTTP 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ChatTemplateTimeout(ChatTemplateError):
    """Rendering ran past the deadline and was stopped."""


class ChatTemplateTooLarge(ChatTemplateError):
    """The template produced (or tried to build) more text than the budget allows."""


class RequestTemplateNotAllowed(ChatTemplateError):
    """The request carried its own chat_template and the server does not trust those."""
