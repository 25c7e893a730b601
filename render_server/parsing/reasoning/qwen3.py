"""Qwen3: reasoning only between ``<think>`` and ``</think>`` that the model writes itself.

    <think>
    Let me work out ...
    </think>

    The answer is 42.

An output that does not start with ``<think>`` has no reasoning: it is all content. With
``enable_thinking=False`` Qwen3's template puts an empty think block in the prompt and the
output is all content, tags or not.
"""

from __future__ import annotations

from render_server.parsing.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning is the ``<think>...</think>`` block at the start of the output."""

    name = "qwen3"
    requires_start_tag = True
