"""Tool-call parsers, one per model family, by name.

    parser = get_tool_parser("hermes")(request_tools)  # one instance per choice
    for text in deltas:
        message = parser.feed(text)  # DeltaMessage: content, and calls that became whole
    message = parser.finish()

or, for a whole output, ``parser.extract(text)`` -> `ExtractedToolCalls`.
"""

from __future__ import annotations

from render_server.parsing.registry import UnknownNameError, lookup
from render_server.parsing.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    Tools,
)
from render_server.parsing.tool_parsers.hermes import HermesToolParser
from render_server.parsing.tool_parsers.llama3_json import Llama3JsonToolParser
from render_server.parsing.tool_parsers.mistral import MistralToolParser
from render_server.parsing.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        PythonicToolParser,
    )
}


class UnknownToolParserError(UnknownNameError):
    """No tool parser has this name; the message lists those that exist."""


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; instantiate it once per choice with the tools."""
    return lookup(TOOL_PARSERS, name, "tool parser", UnknownToolParserError)


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolParser",
    "Tools",
    "UnknownToolParserError",
    "get_tool_parser",
]
