"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the reply itself is the call.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Calls are recognised only at the start of the output (after whitespace and an optional
``<|python_tag|>``), separated by ``;``: a JSON object in the middle of prose is prose. After
the last call, anything that is not ``;`` and another call is content. ``<|python_tag|>`` is
a special token, so it is only seen when the detokenizer keeps special tokens; either way
works. "arguments" is accepted for "parameters".
"""

from __future__ import annotations

from enum import Enum

from render_server.parsing.tool_parsers.base import Status, ToolParser, Tools
from render_server.parsing.tool_parsers.json_call import JsonCallReader
from render_server.parsing.tool_parsers.json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class _State(Enum):
    START = 1  # nothing but whitespace so far
    CALL = 2
    AFTER = 3  # after a call: ";" and another, or the end of the calls
    PROSE = 4  # everything from here on is content


class Llama3JsonToolParser(ToolParser):
    """Parses a reply made of ``{"name": ..., "parameters": {...}}`` objects joined by ``;``."""

    name = "llama3_json"

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = _State.START
        self._reader: JsonCallReader | None = None

    def _open_call(self, pos: int) -> None:
        self._begin_attempt(pos)
        self._reader = JsonCallReader(self.is_known_tool, self._start_call, self._emit_args)
        self._state = _State.CALL

    def _consume(self, text: str, final: bool) -> None:
        pos = 0
        while True:
            if self._state is _State.START:
                start = skip_ws(text, pos)
                self._emit_content(text[pos:start])  # held, and dropped if a call follows
                pos = start
                if pos == len(text):
                    return
                if text.startswith(PYTHON_TAG, pos):
                    self._open_call(pos)
                    pos += len(PYTHON_TAG)
                elif not final and PYTHON_TAG.startswith(text[pos:]):
                    self._tail = text[pos:]
                    return
                elif text[pos] == "{":
                    self._open_call(pos)
                else:
                    self._state = _State.PROSE
            elif self._state is _State.CALL:
                assert self._reader is not None
                pos, status = self._reader.feed(text, pos)
                if status is Status.NEED_MORE and not final:
                    return
                if self._reader.committed:
                    self._end_call()
                    self._state = _State.AFTER if status is Status.DONE else _State.PROSE
                else:
                    self._fail_attempt(text, pos)
                    self._state = _State.PROSE
                self._reader = None
                if status is Status.NEED_MORE:
                    return
            elif self._state is _State.AFTER:
                start = skip_ws(text, pos)
                self._emit_content(text[pos:start])  # held, and dropped if a call follows
                pos = start
                if pos == len(text):
                    return
                if text[pos] == ";":
                    self._open_call(pos)  # a failed next call gives its ";" back as content
                    pos += 1
                else:
                    self._state = _State.PROSE
            else:  # _State.PROSE
                self._emit_content(text[pos:])
                return
