"""Hermes-style calls (Hermes 2 Pro / 3, Qwen2.5, QwQ): JSON objects inside tags, anywhere.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text outside the tags is content. A closing tag is optional (an output cut off after the
object still makes a call); anything after the object other than whitespace and the closing
tag is content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from render_server.parsing.tool_parsers.base import Status, ToolParser, Tools, partial_tag_len
from render_server.parsing.tool_parsers.json_call import JsonCallReader
from render_server.parsing.tool_parsers.json_scan import StateEnum, skip_ws

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _State(StateEnum):
    CONTENT = 1
    CALL = 2  # inside <tool_call>, reading the object
    CLOSE = 3  # after the object: whitespace, then maybe </tool_call>


class HermesToolParser(ToolParser):
    """Parses ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several allowed."""

    name = "hermes"
    template_marker = OPEN_TAG

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = _State.CONTENT
        self._reader: JsonCallReader | None = None

    def _step_content(self, text: str, pos: int, final: bool) -> int:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            keep = 0 if final else partial_tag_len(text, pos, OPEN_TAG)
            self._emit_content(text[pos : len(text) - keep])
            self._tail = text[len(text) - keep :]
            return -1
        body = skip_ws(text, start + len(OPEN_TAG))
        if body < len(text) and text[body] != "{":
            # Plainly not a call (the reader would fail right here): skip the attempt.
            self._emit_content(text[pos:body])
            return body
        self._emit_content(text[pos:start])
        self._begin_attempt(start)
        self._reader = JsonCallReader(self.is_known_tool)
        self._state = _State.CALL
        return start + len(OPEN_TAG)

    def _step_call(self, text: str, pos: int, final: bool) -> int:
        assert self._reader is not None
        pos, status = self._feed_call(self._reader, text, pos, final)
        if status is not Status.NEED_MORE:
            self._state = _State.CLOSE if status is Status.DONE else _State.CONTENT
            self._reader = None
        return pos

    def _step_close(self, text: str, pos: int, final: bool) -> int:
        start = skip_ws(text, pos)
        self._emit_content(text[pos:start])  # held: content only if no tag follows
        pos = start
        if text.startswith(CLOSE_TAG, pos):
            self._drop_held_ws()
            pos += len(CLOSE_TAG)
        elif not final and CLOSE_TAG.startswith(text[pos:]):
            self._tail = text[pos:]  # empty, or the closing tag's beginning
            return -1
        self._state = _State.CONTENT
        return pos

    # The state -> step table (plain functions: `_consume` passes self).
    _STEPS: ClassVar[dict[_State, Callable[[HermesToolParser, str, int, bool], int]]] = {
        _State.CONTENT: _step_content,
        _State.CALL: _step_call,
        _State.CLOSE: _step_close,
    }
