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

from enum import Enum

from render_server.parsing.tool_parsers.base import Status, ToolParser, Tools, partial_tag_len
from render_server.parsing.tool_parsers.json_call import JsonCallReader
from render_server.parsing.tool_parsers.json_scan import skip_ws

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _State(Enum):
    CONTENT = 1
    CALL = 2  # inside <tool_call>, reading the object
    CLOSE = 3  # after the object: whitespace, then maybe </tool_call>


class HermesToolParser(ToolParser):
    """Parses ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several allowed."""

    name = "hermes"

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = _State.CONTENT
        self._reader: JsonCallReader | None = None

    def _consume(self, text: str, final: bool) -> None:
        pos = 0
        while True:
            if self._state is _State.CONTENT:
                start = text.find(OPEN_TAG, pos)
                if start < 0:
                    keep = 0 if final else partial_tag_len(text, pos, OPEN_TAG)
                    self._emit_content(text[pos : len(text) - keep])
                    self._tail = text[len(text) - keep :]
                    return
                body = skip_ws(text, start + len(OPEN_TAG))
                if body < len(text) and text[body] != "{":
                    # Plainly not a call (the reader would fail right here): skip the attempt.
                    self._emit_content(text[pos:body])
                    pos = body
                    continue
                self._emit_content(text[pos:start])
                self._begin_attempt(start)
                self._reader = JsonCallReader(self.is_known_tool, self._start_call, self._emit_args)
                self._state = _State.CALL
                pos = start + len(OPEN_TAG)
            elif self._state is _State.CALL:
                assert self._reader is not None
                pos, status = self._reader.feed(text, pos)
                if status is Status.NEED_MORE and not final:
                    return
                if self._reader.committed:
                    self._end_call()
                    ok = status is Status.DONE
                    self._state = _State.CLOSE if ok else _State.CONTENT
                else:
                    self._fail_attempt(text, pos)
                    self._state = _State.CONTENT
                self._reader = None
                if status is Status.NEED_MORE:  # final: the output ended inside the call
                    return
            else:  # _State.CLOSE
                start = skip_ws(text, pos)
                self._emit_content(text[pos:start])  # held: content only if no tag follows
                pos = start
                if text.startswith(CLOSE_TAG, pos):
                    self._drop_held_ws()
                    pos += len(CLOSE_TAG)
                elif not final and CLOSE_TAG.startswith(text[pos:]):
                    self._tail = text[pos:]  # empty, or the closing tag's beginning
                    return
                self._state = _State.CONTENT
