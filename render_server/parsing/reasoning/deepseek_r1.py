"""DeepSeek-R1 (and its distills, QwQ): the chat template may open ``<think>`` itself.

    <think>
    The user wants ...
    </think>

    The answer is 42.

With R1's template the prompt ends in ``<think>\\n``, so the output starts inside the
reasoning and only closes it: text before ``</think>`` is reasoning with or without an
opening tag. An output with no ``</think>`` at all is all reasoning (it was cut off).
"""

from __future__ import annotations

from render_server.parsing.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning is everything before ``</think>``; a leading ``<think>`` is optional."""

    name = "deepseek_r1"
    requires_start_tag = False
