"""What every reasoning parser shares: splitting ``<think>...</think>`` from the answer.

A parser instance serves one choice of one request. `feed` takes each new piece of model text
and returns the reasoning and content it made certain; `finish` closes the stream; `extract`
runs a fresh instance over a whole text, so the non-streamed split is the streamed one,
however the text was split, by construction. A piece that may be the beginning of a tag is
held back until the next piece (or the end) settles it.

Rules: the start tag counts only at the very start of the output (after whitespace); the
content's leading whitespace after the end tag is dropped; an output that ends inside the
reasoning is all reasoning. Once `is_reasoning_done`, everything is content verbatim: that is
where tool-call parsing and structured-output checks begin.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, NamedTuple

from render_server.parsing.tool_parsers.base import partial_tag_len

WHITESPACE = " \t\n\r"


class ReasoningDelta(NamedTuple):
    """Text made certain by one `feed` or `finish` (None where there is none)."""

    reasoning: str | None
    content: str | None


class _State(Enum):
    OPENING = 1  # only whitespace so far: is the start tag coming?
    REASONING = 2
    CONTENT = 3


class ReasoningParser:
    """Base of the reasoning parsers: one instance per choice of one request.

    ``enable_thinking`` comes from the request's ``chat_template_kwargs.enable_thinking``;
    when False the model was told not to think, and the whole output is content. Subclasses
    set the tags and whether the output must open the reasoning itself.
    """

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # False when the chat template may already have opened the reasoning in the prompt: text
    # before the end tag is reasoning even without a start tag.
    requires_start_tag: ClassVar[bool] = True

    @classmethod
    def prompt_ends_reasoning(cls, prompt_tail: str) -> bool:
        """Whether the prompt (its last turn, as text) closed the reasoning already: an end
        tag after the last start tag, as a template that renders thinking off writes an
        empty think block. vLLM's reasoning parsers answer the same from prompt ids."""
        end = prompt_tail.rfind(cls.end_tag)
        return end >= 0 and end > prompt_tail.rfind(cls.start_tag)

    def __init__(self, *, enable_thinking: bool = True) -> None:
        self.enable_thinking = enable_thinking
        self._state = _State.OPENING if enable_thinking else _State.CONTENT
        self._tail = ""  # a possible partial tag, seen again with the next piece
        self._lead: list[str] = []  # whitespace before a possible start tag
        self._strip_content = False  # just after the end tag
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    @property
    def is_reasoning_done(self) -> bool:
        """True once the reasoning has ended (or there is none): the rest is the answer."""
        return self._state is _State.CONTENT

    def feed(self, delta_text: str) -> ReasoningDelta:
        """Consume the next piece of model output; return what is now certain."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        text, self._tail = self._tail + delta_text, ""
        self._consume(text, final=False)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The output ended: release anything held back."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        text, self._tail = self._tail, ""
        self._consume(text, final=True)
        self._finished = True
        return self._take()

    def extract(self, text: str) -> ReasoningDelta:
        """Split a whole output into (reasoning, content); this instance is left untouched."""
        parser = type(self)(enable_thinking=self.enable_thinking)
        first, last = parser.feed(text), parser.finish()
        reasoning = (first.reasoning or "") + (last.reasoning or "")
        content = (first.content or "") + (last.content or "")
        return ReasoningDelta(reasoning or None, content or None)

    def _consume(self, text: str, final: bool) -> None:
        pos, n = 0, len(text)
        if self._state is _State.OPENING:
            start = len(text) - len(text.lstrip(WHITESPACE))
            self._lead.append(text[:start])
            pos = start
            if text.startswith(self.start_tag, pos):
                self._lead.clear()
                pos += len(self.start_tag)
                self._state = _State.REASONING
            elif pos == n and not final:
                return
            elif not final and self.start_tag.startswith(text[pos:]):
                self._tail = text[pos:]
                return
            else:  # no start tag: the lead belongs to whatever the output is
                self._state = _State.CONTENT if self.requires_start_tag else _State.REASONING
                out = self._content if self._state is _State.CONTENT else self._reasoning
                out.extend(self._lead)
                self._lead.clear()
        if self._state is _State.REASONING:
            end = text.find(self.end_tag, pos)
            if end < 0:
                keep = 0 if final else partial_tag_len(text, pos, self.end_tag)
                self._reasoning.append(text[pos : n - keep])
                self._tail = text[n - keep :]
                return
            self._reasoning.append(text[pos:end])
            pos = end + len(self.end_tag)
            self._state = _State.CONTENT
            self._strip_content = True
        rest = text[pos:]
        if self._strip_content:
            rest = rest.lstrip(WHITESPACE)
            self._strip_content = not rest
        self._content.append(rest)

    def _take(self) -> ReasoningDelta:
        reasoning = "".join(self._reasoning) or None
        content = "".join(self._content) or None
        self._reasoning.clear()
        self._content.clear()
        return ReasoningDelta(reasoning, content)
