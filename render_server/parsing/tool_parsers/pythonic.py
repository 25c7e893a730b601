"""Pythonic tool calls (Llama 3.2, Llama 4, ToolACE): the reply is a Python list of calls.

    [get_weather(city="Paris", unit='celsius'), get_time(tz=None)]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>

Calls are recognised only at the start of the output (after whitespace and an optional
``<|python_start|>``). Arguments are keyword arguments whose values are Python literals;
they are read with `ast` (parsed, never evaluated) and sent as JSON. Text after the list
(and ``<|python_end|>``) is content.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from render_server.parsing.tool_parsers.base import Status, ToolParser, Tools
from render_server.parsing.tool_parsers.json_scan import StateEnum, skip_ws

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


class _State(StateEnum):
    START = 1  # nothing but whitespace so far
    OPEN = 2  # after <|python_start|>: "["
    ELEMENT = 3  # a call's name must start here
    NAME = 4
    BODY = 5  # inside the call's parentheses
    AFTER = 6  # "," and another call, or "]"
    END = 7  # after "]": maybe <|python_end|>
    PROSE = 8  # everything from here on is content


class _Lex(StateEnum):
    """Where the body scanner is in Python's lexical structure."""

    CODE = 1
    QUOTES = 2  # counting the quotes that open a string: '' or '''?
    SHORT = 3  # in a '...' string
    LONG = 4  # in a '''...''' string
    COMMENT = 5


class PythonicToolParser(ToolParser):
    """Parses a reply that is a Python list of calls with literal keyword arguments."""

    name = "pythonic"
    # vLLM's Llama 3.2 / 4 pythonic templates show the format with this example.
    template_marker = "[func_name1(params_name1=params_value1"

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

    # An attempt is open from ELEMENT (or OPEN) until its call is sent or given up.

    def _step_start(self, text: str, pos: int, final: bool) -> int:
        start = skip_ws(text, pos)
        self._emit_content(text[pos:start])  # held, and dropped if a call follows
        pos = start
        if pos == len(text):
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

    def _step_open(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return self._out_of_text(text, final)
        if text[pos] != "[":
            return self._give_up(text, pos)
        self._state = _State.ELEMENT
        return pos + 1

    def _step_element(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return self._out_of_text(text, final)
        if not _NAME_START.match(text[pos]):
            return self._give_up(text, pos)
        self._state, self._call = _State.NAME, []
        return pos

    def _step_name(self, text: str, pos: int, final: bool) -> int:
        name_run = _NAME_RUN.match(text, pos)
        assert name_run is not None  # "*" matches the empty string
        end = name_run.end()
        self._call.append(text[pos:end])
        if end == len(text):
            return self._out_of_text(text, final)
        self._name = "".join(self._call)
        if text[end] != "(" or not self.is_known_tool(self._name):
            return self._give_up(text, end)
        self._call.append("(")
        self._state, self._depth, self._lex = _State.BODY, 1, _Lex.CODE
        return end + 1

    def _step_body(self, text: str, pos: int, final: bool) -> int:
        end, status = self._scan_body(text, pos)
        self._call.append(text[pos:end])
        if status is Status.FAILED:
            return self._give_up(text, end)
        if status is Status.NEED_MORE:
            return self._out_of_text(text, final)
        return self._close_call(text, end)

    def _step_after(self, text: str, pos: int, final: bool) -> int:
        start = skip_ws(text, pos)
        self._emit_content(text[pos:start])  # held: content only if the list ends early
        if start == len(text):
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

    def _step_end(self, text: str, pos: int, final: bool) -> int:
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

    def _step_prose(self, text: str, pos: int, final: bool) -> int:
        self._emit_content(text[pos:])
        return -1

    # The state -> step table (plain functions: `_consume` passes self).
    _STEPS: ClassVar[dict[_State, Callable[[PythonicToolParser, str, int, bool], int]]] = {
        _State.START: _step_start,
        _State.OPEN: _step_open,
        _State.ELEMENT: _step_element,
        _State.NAME: _step_name,
        _State.BODY: _step_body,
        _State.AFTER: _step_after,
        _State.END: _step_end,
        _State.PROSE: _step_prose,
    }

    def _close_call(self, text: str, end: int) -> int:
        """The call's ``)`` is at end - 1: send it if it is a valid literal call."""
        parsed = parse_call("".join(self._call))
        self._call = []
        if parsed is None:
            return self._give_up(text, end)
        self._add_call(*parsed)
        self._state = _State.AFTER
        return end

    def _out_of_text(self, text: str, final: bool) -> int:
        """The text ran out inside a call not yet sent: wait, or give it back at the end."""
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
        # Each lexer (`_LEXERS`) reads on while its lexical state lasts, and returns where it
        # stopped: with None to go on (in the next state, or for more text), or with DONE
        # (past the closing ")") or FAILED (at the offending character).
        n = len(text)
        while pos < n:
            pos, status = self._LEXERS[self._lex](self, text, pos)
            if status is not None:
                return pos, status
        return n, Status.NEED_MORE

    def _lex_code(self, text: str, pos: int) -> tuple[int, Status | None]:
        """Code: brackets are counted (self._depth, the call's "(" included)."""
        n = len(text)
        while pos < n:
            run = _CODE_RUN.match(text, pos)
            if run:
                pos = run.end()
                if pos == n:
                    break
            ch = text[pos]
            pos += 1
            if ch in "([{":
                if self._depth >= MAX_DEPTH:
                    return pos - 1, Status.FAILED
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if not self._depth:  # the call's own bracket: it must be its ")"
                    return (pos, Status.DONE) if ch == ")" else (pos - 1, Status.FAILED)
            elif ch == "#":
                self._lex = _Lex.COMMENT
                return pos, None
            else:  # a quote
                self._lex, self._quote, self._quotes = _Lex.QUOTES, ch, 1
                return pos, None
        return pos, None

    def _lex_quotes(self, text: str, pos: int) -> tuple[int, Status | None]:
        """After one or two opening quotes: a third opens a long string."""
        if text[pos] == self._quote:
            self._quotes += 1
            if self._quotes == 3:
                self._lex, self._quotes = _Lex.LONG, 0
            return pos + 1, None
        # '' is an empty string; after a single quote, this is a string's first character.
        self._lex = _Lex.CODE if self._quotes == 2 else _Lex.SHORT
        return pos, None

    def _lex_comment(self, text: str, pos: int) -> tuple[int, Status | None]:
        comment = _COMMENT_RUN.match(text, pos)
        assert comment is not None  # "*" matches the empty string
        pos = comment.end()
        if pos < len(text):  # at the newline, which is code
            self._lex = _Lex.CODE
        return pos, None

    def _lex_short(self, text: str, pos: int) -> tuple[int, Status | None]:
        """In a '...' string, which a newline before its closing quote leaves unterminated."""
        n = len(text)
        run_of = _SHORT_STRING_RUN[self._quote]
        while pos < n:
            if self._escape:  # the character after a backslash
                self._escape = False
                pos += 1
                continue
            run = run_of.match(text, pos)
            if run:
                pos = run.end()
                continue
            ch = text[pos]
            if ch == "\n":
                return pos, Status.FAILED
            pos += 1
            if ch == "\\":
                self._escape = True
            else:  # the closing quote
                self._lex = _Lex.CODE
                return pos, None
        return pos, None

    def _lex_long(self, text: str, pos: int) -> tuple[int, Status | None]:
        """In a '''...''' string: self._quotes counts the quotes in a row, and three close it."""
        n = len(text)
        run_of = _LONG_STRING_RUN[self._quote]
        while pos < n:
            if self._escape:  # the character after a backslash
                self._escape = False
                pos += 1
                continue
            run = run_of.match(text, pos)
            if run:
                pos, self._quotes = run.end(), 0
                continue
            ch = text[pos]
            pos += 1
            if ch == "\\":
                self._escape, self._quotes = True, 0
                continue
            self._quotes += 1
            if self._quotes == 3:
                self._lex, self._quotes = _Lex.CODE, 0
                return pos, None
        return pos, None

    # The lexical state -> lexer table (plain functions: `_scan_body` passes self).
    _LEXERS: ClassVar[
        dict[_Lex, Callable[[PythonicToolParser, str, int], tuple[int, Status | None]]]
    ] = {
        _Lex.CODE: _lex_code,
        _Lex.QUOTES: _lex_quotes,
        _Lex.COMMENT: _lex_comment,
        _Lex.SHORT: _lex_short,
        _Lex.LONG: _lex_long,
    }


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
