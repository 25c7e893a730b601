"""Reasoning parsers (think tags), one per model family, by name.

    parser = get_reasoning_parser("qwen3")(enable_thinking=True)  # one instance per choice
    for text in deltas:
        reasoning, content = parser.feed(text)  # content only once parser.is_reasoning_done
    reasoning, content = parser.finish()

or, for a whole output, ``parser.extract(text)`` -> (reasoning, content).
"""

from __future__ import annotations

from render_server.parsing.reasoning.base import ReasoningDelta, ReasoningParser
from render_server.parsing.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from render_server.parsing.reasoning.qwen3 import Qwen3ReasoningParser
from render_server.parsing.registry import UnknownNameError, lookup

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


class UnknownReasoningParserError(UnknownNameError):
    """No reasoning parser has this name; the message lists those that exist."""


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; instantiate it once per choice."""
    return lookup(REASONING_PARSERS, name, "reasoning parser", UnknownReasoningParserError)


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "UnknownReasoningParserError",
    "get_reasoning_parser",
]
