"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the reply itself is the call.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Calls are recognised only at the start of the output (after whitespace and an optional
``<|python_tag|>``), separated by ``;``: a JSON object in the middle of prose is prose. After
the last call, anything that is not ``;`` and another call is content. ``<|python_tag|>`` is
a special token, so it is only seen when the detokenizer keeps special tokens; either way
works. "arguments" is accepted for "parameters".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from render_server.parsing.tool_parsers.base import Status, ToolParser, Tools
from render_server.parsing.tool_parsers.json_call import JsonCallReader
from render_server.parsing.tool_parsers.json_scan import StateEnum, skip_ws

PYTHON_TAG = "<|python_tag|>"


class _State(StateEnum):
    START = 1  # nothing but whitespace so far
    CALL = 2
    AFTER = 3  # after a call: ";" and another, or the end of the calls
    PROSE = 4  # everything from here on is content


class Llama3JsonToolParser(ToolParser):
    """Parses a reply made of ``{"name": ..., "parameters": {...}}`` objects joined by ``;``."""

    name = "llama3_json"
    # Llama 3.1 / 3.2 / 3.3 templates describe the format in these words.
    template_marker = '"parameters": dictionary of argument name and its value'

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = _State.START
        self._reader: JsonCallReader | None = None

    def _open_call(self, pos: int) -> None:
        self._begin_attempt(pos)
        self._reader = JsonCallReader(self.is_known_tool)
        self._state = _State.CALL

    def _step_start(self, text: str, pos: int, final: bool) -> int:
        start = skip_ws(text, pos)
        self._emit_content(text[pos:start])  # held, and dropped if a call follows
        pos = start
        if pos == len(text):
            return -1
        if text.startswith(PYTHON_TAG, pos):
            self._open_call(pos)
            return pos + len(PYTHON_TAG)
        if not final and PYTHON_TAG.startswith(text[pos:]):
            self._tail = text[pos:]
            return -1
        if text[pos] == "{":
            self._open_call(pos)
        else:
            self._state = _State.PROSE
        return pos

    def _step_call(self, text: str, pos: int, final: bool) -> int:
        assert self._reader is not None
        pos, status = self._feed_call(self._reader, text, pos, final)
        if status is not Status.NEED_MORE:
            self._state = _State.AFTER if status is Status.DONE else _State.PROSE
            self._reader = None
        return pos

    def _step_after(self, text: str, pos: int, final: bool) -> int:
        start = skip_ws(text, pos)
        self._emit_content(text[pos:start])  # held, and dropped if a call follows
        pos = start
        if pos == len(text):
            return -1
        if text[pos] == ";":
            self._open_call(pos)  # a failed next call gives its ";" back as content
            return pos + 1
        self._state = _State.PROSE
        return pos

    def _step_prose(self, text: str, pos: int, final: bool) -> int:
        self._emit_content(text[pos:])
        return -1

    # The state -> step table (plain functions: `_consume` passes self).
    _STEPS: ClassVar[dict[_State, Callable[[Llama3JsonToolParser, str, int, bool], int]]] = {
        _State.START: _step_start,
        _State.CALL: _step_call,
        _State.AFTER: _step_after,
        _State.PROSE: _step_prose,
    }
