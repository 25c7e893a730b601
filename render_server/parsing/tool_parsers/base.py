"""What every tool-call parser shares: the result types, content emission, call bookkeeping.

A parser instance serves one choice of one request. The streaming side is the only
implementation: `feed` takes each new piece of model text and returns what became certain,
`finish` closes the stream, and `extract` runs a fresh instance over a whole text at once. So
the non-streamed result is the streamed one, however the text was split, by construction.

Rules every format follows:
- A call is sent only once it is well formed: its name is a known tool and its arguments are
  complete and valid (a JSON object, or literals that make one). It is then sent whole, in one
  delta with its id, name and arguments. Before that, its text is held back.
- Text that turns out not to be a well-formed call (bad JSON, an unknown name, output cut off
  inside the call) is content, verbatim, as vLLM leaves it. A call is never taken back, so it
  cannot be sent earlier: streaming the arguments as they come would commit to a call whose
  JSON may still break, and the stream would then disagree with the whole result.
- JSON arguments are the model's own characters (raw control characters inside strings are
  sent escaped, so that they are valid JSON); nothing is invented or reformatted.
- Whitespace between content and a call, between calls, and after the last call is dropped,
  so a reply that is only calls has no content. Text after a call keeps the whitespace that
  leads it, so "A <call> B" gives the content "A B".
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

from render_server.parsing.tool_parsers.json_scan import WHITESPACE, StateEnum

_ALPHANUMERIC = string.ascii_letters + string.digits
# A random byte below 248 (4 x 62) maps to one of 62 characters, each equally likely.
_ID_DIGITS = bytes.maketrans(bytes(range(248)), (_ALPHANUMERIC * 4).encode("ascii"))
_ID_DROP = bytes(range(248, 256))

# A request's tool definitions, OpenAI-shaped; None means "any name is a tool".
Tools = Sequence[Mapping[str, Any]] | None


class Status(Enum):
    """Where a reader stands after a `feed`."""

    NEED_MORE = 1  # consumed everything; the call goes on in the next text
    DONE = 2  # the call ended; pos is just past it
    FAILED = 3  # text[pos] cannot continue the call; it was not consumed


class CallReader(Protocol):
    """Reads one call's text as it arrives (`json_call.JsonCallReader`)."""

    def feed(self, text: str, pos: int) -> tuple[int, Status]: ...

    @property
    def call(self) -> tuple[str, str]: ...


@dataclass
class ToolCall:
    """One well-formed tool call; ``arguments`` is the JSON text of an object, as OpenAI
    sends it."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """A whole output split into content (None when there is none) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class DeltaMessage:
    """What one `feed` or `finish` made certain: content text and the calls that became
    well formed, each whole, in output order."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.content is None and not self.tool_calls


def random_alphanumeric(size: int) -> str:
    """``size`` random letters and digits, for call ids (uniform: bytes past the last whole
    multiple of 62 are dropped, not folded)."""
    digits = b""
    while len(digits) < size:
        digits += secrets.token_bytes(size + 8).translate(_ID_DIGITS, _ID_DROP)
    return digits[:size].decode("ascii")


def tool_names(tools: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """Function names of OpenAI-shaped tool definitions ({"type": "function", "function":
    {"name": ...}}); entries of other shapes name nothing."""
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


def partial_tag_len(text: str, start: int, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text[start:]`` ends with: the
    characters to hold back because the next piece may complete the tag."""
    # Such a prefix starts with the tag's first character, within its last len(tag)-1.
    at = text.find(tag[0], max(start, len(text) - len(tag) + 1))
    while at >= 0:
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0


class ToolParser:
    """Base of the tool-call parsers: one instance per choice of one request.

    ``tools`` are the request's tool definitions (OpenAI shape); a call to a name not among
    them is not a call but content. ``tools=None`` accepts any name.

    A subclass is a state machine: ``_state`` is its current state and ``_STEPS`` maps each
    state to a step, ``step(self, text, pos, final) -> int``, which advances over ``text``
    from ``pos`` with the helpers below and returns the next position, or -1 once the text
    is used up (with ``final``, only once nothing is held back).
    """

    name: ClassVar[str] = ""
    template_marker: ClassVar[str | None] = None
    """Text found only in chat templates that ask for this format: a template holding it
    picks this parser when the operator names none (`tool_choice.tool_setup`)."""
    _STEPS: ClassVar[Mapping[Any, Callable[[Any, str, int, bool], int]]]
    _state: StateEnum

    def __init__(self, tools: Tools = None) -> None:
        self.tools = list(tools) if tools is not None else None
        self._names = tool_names(self.tools) if self.tools is not None else None
        # Text a state needs to see again with the next piece (a partial tag); it is never
        # longer than a tag, and an attempt (below) never has one.
        self._tail = ""
        # The current attempt: text that may be a call, not yet sent. It started at
        # self._attempt_from in the text being consumed, and earlier texts are in _pending.
        self._attempt_from: int | None = None
        self._pending: list[str] = []
        # Trailing whitespace of the content, not sent yet: a call starting next drops it.
        self._ws_hold: list[str] = []
        self._ws_after_call = False  # ... and the end of the output drops it after a call
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    # -- public API ----------------------------------------------------------------------

    def is_known_tool(self, name: str) -> bool:
        return self._names is None or name in self._names

    def feed(self, delta_text: str) -> DeltaMessage:
        """Consume the next piece of model output; return what is now certain."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        text, self._tail = self._tail + delta_text, ""
        if self._attempt_from is not None:
            self._attempt_from = 0
        self._consume(text, final=False)
        if self._attempt_from is not None:
            self._pending.append(text[self._attempt_from :])
        return self._take()

    def finish(self) -> DeltaMessage:
        """The output ended: resolve everything held back and return the last pieces."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        text, self._tail = self._tail, ""
        if self._attempt_from is not None:
            self._attempt_from = 0
        self._consume(text, final=True)
        assert self._attempt_from is None and not self._tail, "final consume left text held"
        self._finished = True
        if not self._ws_after_call:
            self._content.extend(self._ws_hold)
        self._ws_hold.clear()
        return self._take()

    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a whole output at once (this instance's stream is left untouched)."""
        parser = type(self)(self.tools)
        content: list[str] = []
        calls: list[ToolCall] = []
        for message in (parser.feed(text), parser.finish()):
            if message.content:
                content.append(message.content)
            calls += message.tool_calls
        return ExtractedToolCalls("".join(content) or None, calls)

    # -- for subclasses ------------------------------------------------------------------

    def _consume(self, text: str, final: bool) -> None:
        """Advance over ``text`` (the held tail plus the new piece), a step at a time. With
        ``final``, nothing may stay held: every attempt is resolved into a call or content."""
        pos = 0
        while pos >= 0:
            pos = self._STEPS[self._state](self, text, pos, final)

    def _new_call_id(self) -> str:
        return "call_" + random_alphanumeric(24)

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip(WHITESPACE)
        if body:
            self._content.extend(self._ws_hold)
            self._ws_hold.clear()
            self._content.append(body)
            self._ws_after_call = False
        if len(body) < len(text):
            self._ws_hold.append(text[len(body) :])

    def _begin_attempt(self, pos: int) -> None:
        """Text from ``pos`` on may be a call: hold it back."""
        assert self._attempt_from is None and not self._pending
        self._attempt_from = pos

    def _fail_attempt(self, text: str, pos: int) -> None:
        """The attempt is not a well-formed call: everything it held, up to ``pos``, is
        content."""
        assert self._attempt_from is not None
        held = "".join(self._pending) + text[self._attempt_from : pos]
        self._attempt_from = None
        self._pending.clear()
        self._emit_content(held)

    def _add_call(self, name: str, arguments: str) -> None:
        """The attempt is a well-formed call: send it, and drop the whitespace before it."""
        self._attempt_from = None
        self._pending.clear()
        self._ws_hold.clear()
        self._ws_after_call = True
        self._calls.append(ToolCall(self._new_call_id(), name, arguments))

    def _feed_call(
        self, reader: CallReader, text: str, pos: int, final: bool
    ) -> tuple[int, Status]:
        """Feed the call being read. DONE: it is well formed and sent; FAILED: it is not
        (or the output ended inside it), so its text is content; NEED_MORE (pos -1): wait
        for more text."""
        pos, status = reader.feed(text, pos)
        if status is Status.NEED_MORE:
            if not final:
                return -1, status
            status = Status.FAILED
        if status is Status.DONE:
            self._add_call(*reader.call)
        else:
            self._fail_attempt(text, pos)
        return pos, status

    def _drop_held_ws(self) -> None:
        """The held whitespace lies inside a call block (before its closing tag): drop it."""
        self._ws_hold.clear()

    def _take(self) -> DeltaMessage:
        message = DeltaMessage("".join(self._content) or None, self._calls)
        self._content.clear()
        self._calls = []
        return message
