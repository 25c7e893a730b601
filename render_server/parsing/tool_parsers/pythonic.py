"""Pythonic tool calls (Llama 3.2, Llama 4, ToolACE): the reply is a Python list of calls.

    [get_weather(city="Paris", unit='celsius'), get_time(tz=None)]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>

Calls are recognised only at the start of the output (after whitespace and an optional
``<|python_start|>``). Arguments are keyword arguments whose values are Python literals;
they are read with `ast` (parsed, never evaluated) and sent as JSON. Since Python text is
not JSON, a call is announced whole, name and arguments together, when its ``)`` arrives.
Text after the list (and ``<|python_end|>``) is content.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from enum import Enum
from typing import Any

from render_server.parsing.tool_parsers.base import Status, ToolParser, Tools
from render_server.parsing.tool_parsers.json_scan import skip_ws

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
# CPython's parser refuses more nesting than this anyway ("too many nested parentheses").
MAX_DEPTH = 200

_CODE_RUN = re.compile(r"[^()\[\]{}'\"#]+")
_NAME_START = re.compile(r"[A-Za-z_]")
_NAME_RUN = re.compile(r"[A-Za-z0-9_]*")
_COMMENT_RUN = re.compile(r"[^\n]*")
_SHORT_STRING_RUN = {q: re.compile(rf"[^\\\n{q}]+") for q in "'\""}
_LONG_STRING_RUN = {q: re.compile(rf"[^\\{q}]+") for q in "'\""}


class _State(Enum):
    START = 1  # nothing but whitespace so far
    OPEN = 2  # after <|python_start|>: "["
    ELEMENT = 3  # a call's name must start here
    NAME = 4
    BODY = 5  # inside the call's parentheses
    AFTER = 6  # "," and another call, or "]"
    END = 7  # after "]": maybe <|python_end|>
    PROSE = 8  # everything from here on is content


class _Lex(Enum):
    """Where the body scanner is in Python's lexical structure."""

    CODE = 1
    QUOTES = 2  # counting the quotes that open a string: '' or '''?
    SHORT = 3  # in a '...' string
    LONG = 4  # in a '''...''' string
    COMMENT = 5


class PythonicToolParser(ToolParser):
    """Parses a reply that is a Python list of calls with literal keyword arguments."""

    name = "pythonic"

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = _State.START
        self._call: list[str] = []  # the current call's text, for ast
        self._name = ""
        self._depth = 0
        self._lex = _Lex.CODE
        self._quote = ""
        self._quotes = 0  # quotes counted in a row (opening, or closing a long string)
        self._escape = False

    def _consume(self, text: str, final: bool) -> None:
        pos = 0
        while pos >= 0:
            pos = self._step(text, pos, final)

    def _step(self, text: str, pos: int, final: bool) -> int:
        """Advance from ``pos``: the next position, or -1 to wait for more text."""
        state, n = self._state, len(text)
        if state is _State.PROSE:
            self._emit_content(text[pos:])
            return -1
        if state is _State.NAME:
            name_run = _NAME_RUN.match(text, pos)
            assert name_run is not None  # "*" matches the empty string
            end = name_run.end()
            self._call.append(text[pos:end])
            if end == n:
                return self._out_of_text(text, final)
            self._name = "".join(self._call)
            if text[end] != "(" or not self.is_known_tool(self._name):
                return self._give_up(text, end)
            self._call.append("(")
            self._state, self._depth, self._lex = _State.BODY, 1, _Lex.CODE
            return end + 1
        if state is _State.BODY:
            end, status = self._scan_body(text, pos)
            self._call.append(text[pos:end])
            if status is Status.FAILED:
                return self._give_up(text, end)
            if status is Status.NEED_MORE:
                return self._out_of_text(text, final)
            return self._close_call(text, end)
        if state is _State.START:
            start = skip_ws(text, pos)
            self._emit_content(text[pos:start])  # held, and dropped if a call follows
            pos = start
            if pos == n:
                return -1
            if text.startswith(START_TAG, pos):
                self._begin_attempt(pos)
                self._state = _State.OPEN
                return pos + len(START_TAG)
            if not final and START_TAG.startswith(text[pos:]):
                self._tail = text[pos:]
                return -1
            if text[pos] != "[":
                self._state = _State.PROSE
                return pos
            self._begin_attempt(pos)
            self._state = _State.ELEMENT
            return pos + 1
        if state is _State.END:
            start = skip_ws(text, pos)
            self._emit_content(text[pos:start])  # held: content only if no tag follows
            pos = start
            if text.startswith(END_TAG, pos):
                self._drop_held_ws()
                self._state = _State.PROSE
                return pos + len(END_TAG)
            if not final and END_TAG.startswith(text[pos:]):
                self._tail = text[pos:]  # empty, or the end tag's beginning
                return -1
            self._state = _State.PROSE
            return pos
        if state is _State.AFTER:
            start = skip_ws(text, pos)
            self._emit_content(text[pos:start])  # held: content only if the list ends early
            if start == n:
                return -1
            if text[start] == ",":
                self._begin_attempt(start)  # a failed call gives its "," back as content
                self._state = _State.ELEMENT
                return start + 1
            if text[start] == "]":
                self._drop_held_ws()
                self._state = _State.END
                return start + 1
            self._state = _State.PROSE
            return start
        # OPEN and ELEMENT start at the next non-whitespace character.
        pos = skip_ws(text, pos)
        if pos == n:
            return self._out_of_text(text, final)
        ch = text[pos]
        if state is _State.OPEN:
            if ch != "[":
                return self._give_up(text, pos)
            self._state = _State.ELEMENT
            return pos + 1
        # _State.ELEMENT
        if not _NAME_START.match(ch):
            return self._give_up(text, pos)
        self._state, self._call = _State.NAME, []
        return pos

    def _close_call(self, text: str, end: int) -> int:
        """The call's ``)`` is at end - 1: announce it if it is a valid literal call."""
        parsed = parse_call("".join(self._call))
        self._call = []
        if parsed is None:
            return self._give_up(text, end)
        name, arguments = parsed
        self._start_call(name)
        self._emit_args(arguments)
        self._end_call()
        self._state = _State.AFTER
        return end

    def _out_of_text(self, text: str, final: bool) -> int:
        """The text ran out inside a call not yet announced: wait, or give it back at the end."""
        if final:
            self._give_up(text, len(text))
        return -1

    def _give_up(self, text: str, pos: int) -> int:
        """Not a call: what the attempt held is content, and so is all that follows."""
        self._fail_attempt(text, pos)
        self._state = _State.PROSE
        return pos

    def _scan_body(self, text: str, pos: int) -> tuple[int, Status]:
        """Scan a call's body for the ``)`` that closes it, through strings and comments.
        Only finds the end; `parse_call` judges what is inside."""
        n = len(text)
        while pos < n:
            lex = self._lex
            if lex is _Lex.CODE:
                run = _CODE_RUN.match(text, pos)
                if run:
                    pos = run.end()
                    continue
                ch = text[pos]
                if ch in "([{":
                    if self._depth >= MAX_DEPTH:
                        return pos, Status.FAILED
                    self._depth += 1
                elif ch in ")]}":
                    self._depth -= 1
                    if not self._depth:
                        return (pos + 1, Status.DONE) if ch == ")" else (pos, Status.FAILED)
                elif ch == "#":
                    self._lex = _Lex.COMMENT
                else:
                    self._lex, self._quote, self._quotes = _Lex.QUOTES, ch, 1
                pos += 1
            elif lex is _Lex.QUOTES:  # after one or two opening quotes
                if text[pos] == self._quote:
                    self._quotes += 1
                    pos += 1
                    if self._quotes == 3:
                        self._lex, self._quotes = _Lex.LONG, 0
                else:  # '' is an empty string; after a single quote, a string's first char
                    self._lex = _Lex.CODE if self._quotes == 2 else _Lex.SHORT
            elif lex is _Lex.COMMENT:
                comment = _COMMENT_RUN.match(text, pos)
                assert comment is not None  # "*" matches the empty string
                pos = comment.end()
                if pos < n:
                    self._lex = _Lex.CODE
            elif self._escape:
                self._escape = False
                pos += 1
            else:
                runs = _SHORT_STRING_RUN if lex is _Lex.SHORT else _LONG_STRING_RUN
                run = runs[self._quote].match(text, pos)
                if run:
                    pos, self._quotes = run.end(), 0
                    continue
                ch = text[pos]
                if ch == "\\":
                    self._escape, self._quotes = True, 0
                elif ch == "\n":  # only a short string stops at a newline: unterminated
                    return pos, Status.FAILED
                elif lex is _Lex.SHORT:
                    self._lex = _Lex.CODE
                else:
                    self._quotes += 1
                    if self._quotes == 3:
                        self._lex, self._quotes = _Lex.CODE, 0
                pos += 1
        return n, Status.NEED_MORE


def parse_call(source: str) -> tuple[str, str] | None:
    """``name(key=literal, ...)`` -> (name, JSON object text), or None if it is not exactly
    that: positional arguments, ``**kwargs`` and non-literal values are refused."""
    try:
        # Model text may hold escapes Python warns about ("\\<"); they are the model's, not
        # ours, and the literal means what Python reads it as.
        with warnings.catch_warnings(action="ignore"):
            tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        return None
    arguments: dict[str, Any] = {}
    try:
        for keyword in call.keywords:
            if keyword.arg is None:
                return None
            arguments[keyword.arg] = _json_value(ast.literal_eval(keyword.value))
        return call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


def _json_value(value: Any) -> Any:
    """A literal as JSON data; raises TypeError for what JSON cannot hold exactly (bytes,
    sets, complex numbers, non-string keys)."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item) for key, item in value.items()}
    raise TypeError(f"{type(value).__name__} is not JSON")
