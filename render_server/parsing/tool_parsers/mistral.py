"""Mistral tool calls, in both of its tokenizers' shapes, after the ``[TOOL_CALLS]`` token.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is Mistral 7B v0.3 / Mixtral / Nemo (tokenizers up to v7), the second the newer
models (v11 and later: Mistral Small 3.2, Magistral, Devstral). ``[TOOL_CALLS]`` is a special
token: the detokenizer must keep special tokens for this parser to see it. Text before it, or
after the array, is content. Mistral's chat template wants 9-character alphanumeric call ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

from render_server.parsing.tool_parsers.base import (
    Status,
    ToolParser,
    Tools,
    partial_tag_len,
    random_alphanumeric,
)
from render_server.parsing.tool_parsers.json_call import JsonCallReader
from render_server.parsing.tool_parsers.json_scan import (
    JsonScanError,
    JsonValueScanner,
    StateEnum,
    skip_ws,
)

TOOL_CALLS_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
_NAME_RUN = re.compile(r"[A-Za-z0-9_.\-]*")


def _name_end(text: str, pos: int) -> int:
    """End of the run of name characters of ``text`` at ``pos`` (``pos`` if there are none)."""
    match = _NAME_RUN.match(text, pos)
    assert match is not None  # "*" matches the empty string
    return match.end()


class _State(StateEnum):
    CONTENT = 1
    SECTION = 2  # after [TOOL_CALLS]: "[" (a JSON array) or a name (the [ARGS] shape)
    ELEMENT = 3  # an object of the array
    ARRAY_NEXT = 4  # "," and another object, or "]"
    NAME = 5
    ARGS_TAG = 6  # matching "[ARGS]"
    ARGS_OPEN = 7  # before the arguments object
    ARGS = 8  # inside it


class MistralToolParser(ToolParser):
    """Parses ``[TOOL_CALLS]`` followed by a JSON array of calls or by ``name[ARGS]{...}``."""

    name = "mistral"
    template_marker = TOOL_CALLS_TAG

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = _State.CONTENT
        self._reader: JsonCallReader | None = None
        self._scanner: JsonValueScanner | None = None
        self._name_parts: list[str] = []
        self._matched = 0  # characters of [ARGS] matched so far

    def _new_call_id(self) -> str:
        return random_alphanumeric(9)

    # An attempt is open from SECTION on until its call is sent or given back.

    def _step_content(self, text: str, pos: int, final: bool) -> int:
        n = len(text)
        start = text.find(TOOL_CALLS_TAG, pos)
        if start < 0:
            keep = 0 if final else partial_tag_len(text, pos, TOOL_CALLS_TAG)
            self._emit_content(text[pos : n - keep])
            self._tail = text[n - keep :]
            return -1
        body = skip_ws(text, start + len(TOOL_CALLS_TAG))
        if body < n and text[body] != "[" and not _name_end(text, body) > body:
            # Plainly not a call (SECTION would fail right here): skip the attempt.
            self._emit_content(text[pos:body])
            return body
        self._emit_content(text[pos:start])
        self._begin_attempt(start)
        self._state = _State.SECTION
        return start + len(TOOL_CALLS_TAG)

    def _step_section(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return self._out_of_text(text, final)
        if text[pos] == "[":
            self._open_element()
            return pos + 1
        if _name_end(text, pos) > pos:
            self._state, self._name_parts = _State.NAME, []
            return pos
        return self._stop(text, pos)

    # -- the array shape -------------------------------------------------------------------

    def _step_element(self, text: str, pos: int, final: bool) -> int:
        assert self._reader is not None
        pos, status = self._reader.feed(text, pos)
        if status is Status.NEED_MORE:
            return self._out_of_text(text, final)
        reader, self._reader = self._reader, None
        if status is Status.FAILED:
            return self._stop(text, pos)
        self._add_call(*reader.call)
        self._state = _State.ARRAY_NEXT
        return pos

    def _step_array_next(self, text: str, pos: int, final: bool) -> int:
        start = skip_ws(text, pos)
        self._emit_content(text[pos:start])  # held: content only if the array ends early
        if start == len(text):
            return -1
        self._state = _State.CONTENT  # unless another element follows
        if text[start] == ",":
            self._begin_attempt(start)  # a failed element gives its "," back as content
            self._open_element()
        elif text[start] == "]":
            self._drop_held_ws()
        return start + 1 if text[start] in ",]" else start

    def _open_element(self) -> None:
        self._reader = JsonCallReader(self.is_known_tool)
        self._state = _State.ELEMENT

    # -- the [ARGS] shape ------------------------------------------------------------------

    def _step_name(self, text: str, pos: int, final: bool) -> int:
        end = _name_end(text, pos)
        self._name_parts.append(text[pos:end])
        if end == len(text):
            return self._out_of_text(text, final)
        name = "".join(self._name_parts)
        if text[end] != "[" or not name or not self.is_known_tool(name):
            return self._stop(text, end)
        self._state, self._matched = _State.ARGS_TAG, 0
        return end

    def _step_args_tag(self, text: str, pos: int, final: bool) -> int:
        n = len(text)
        while pos < n and self._matched < len(ARGS_TAG):
            if text[pos] != ARGS_TAG[self._matched]:
                return self._stop(text, pos)
            pos += 1
            self._matched += 1
        if self._matched < len(ARGS_TAG):
            return self._out_of_text(text, final)
        self._state = _State.ARGS_OPEN
        return pos

    def _step_args_open(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return self._out_of_text(text, final)
        if text[pos] != "{":
            return self._stop(text, pos)
        self._scanner = JsonValueScanner(collect=True, require_object=True)
        self._state = _State.ARGS
        return pos

    def _step_args(self, text: str, pos: int, final: bool) -> int:
        assert self._scanner is not None
        try:
            end = self._scanner.feed(text, pos)
        except JsonScanError as exc:
            self._scanner = None
            return self._stop(text, exc.pos)
        if end < 0:
            return self._out_of_text(text, final)
        scanner, self._scanner = self._scanner, None
        self._add_call("".join(self._name_parts), scanner.take_output())
        self._state = _State.CONTENT
        return end

    # The state -> step table (plain functions: `_consume` passes self).
    _STEPS: ClassVar[dict[_State, Callable[[MistralToolParser, str, int, bool], int]]] = {
        _State.CONTENT: _step_content,
        _State.SECTION: _step_section,
        _State.ELEMENT: _step_element,
        _State.ARRAY_NEXT: _step_array_next,
        _State.NAME: _step_name,
        _State.ARGS_TAG: _step_args_tag,
        _State.ARGS_OPEN: _step_args_open,
        _State.ARGS: _step_args,
    }

    def _out_of_text(self, text: str, final: bool) -> int:
        """The text ran out inside a call not yet sent: wait, or give it back at the end."""
        if final:
            self._stop(text, len(text))
        return -1

    def _stop(self, text: str, pos: int) -> int:
        """Not a well-formed call: give the attempt back as content, up to ``pos``, where
        scanning goes on as content."""
        self._fail_attempt(text, pos)
        self._state = _State.CONTENT
        return pos
