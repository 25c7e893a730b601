"""Incremental, strict JSON scanning for tool-call parsers.

`JsonValueScanner` walks one JSON value a chunk at a time and keeps its state between chunks, so
a stream costs O(total characters) however it is split. It never guesses: it only says "this
character continues a valid JSON prefix", "the value ended here" or "this character is wrong".

`render_server.parsing.tool_parsers.json_call` builds on it to read call objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum
from typing import ClassVar

# Deeper JSON than this is refused: Python's json module (and so anything downstream that
# loads the arguments) recurses per level and fails near 1,000.
MAX_JSON_DEPTH = 512

WHITESPACE = " \t\n\r"
_WS = re.compile(r"[ \t\n\r]*")
# A run of a JSON string's body: plain characters and complete escapes. A raw control
# character, the closing quote or an escape cut off by the chunk's end stops it.
_STRING_RUN = re.compile(r'(?:[^"\\\x00-\x1f]+|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))+')
# A whole string without escapes or control characters: its text is its value.
SIMPLE_STRING = re.compile(r'"([^"\\\x00-\x1f]*)"')
_DIGITS = re.compile(r"[0-9]+")
_HEX = frozenset("0123456789abcdefABCDEF")
_SHORT_ESCAPES = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def skip_ws(text: str, pos: int) -> int:
    """Index of the first non-whitespace character of ``text`` at or after ``pos``."""
    match = _WS.match(text, pos)
    assert match is not None  # "*" matches the empty string
    return match.end()


class StateEnum(Enum):
    """Base of the scanners' and parsers' state enums, whose members key their step tables.

    Members hash by identity, as they compare: a table is looked up once per step, and
    Enum's own ``__hash__`` is Python code, a cost on this hot path (bench/RESULTS.md,
    Design choices).
    """

    __hash__ = object.__hash__


class JsonScanError(ValueError):
    """The character at ``pos`` cannot continue the JSON value."""

    def __init__(self, pos: int) -> None:
        super().__init__(f"invalid JSON at index {pos}")
        self.pos = pos


class _S(StateEnum):
    VALUE = 1  # a value must start here
    ARRAY_FIRST = 2  # just after "[": a value or "]"
    OBJECT_FIRST = 3  # just after "{": a key or "}"
    KEY = 4  # after "," in an object: a key
    COLON = 5
    AFTER_VALUE = 6  # "," or the closing bracket of the innermost container
    STRING = 7
    ESCAPE = 8  # just after a backslash in a string
    UNICODE = 9  # inside \uXXXX
    NUMBER = 10
    LITERAL = 11  # inside true / false / null
    END = 12  # the top-level value ended


# The number grammar as a small DFA over states named for what was read last. A digit, ".",
# "e"/"E" or a sign moves along these tables; anything else ends the number when the state is
# terminal, and is an error otherwise. "minus" then "0" goes to "int0" (no digit may follow).
_DIGIT_NEXT = {"minus": "int", "int": "int", "dot": "frac", "frac": "frac"}
_DIGIT_NEXT |= {"e": "exp", "esign": "exp", "exp": "exp"}
_DOT_NEXT = {"int0": "dot", "int": "dot"}
_EXP_NEXT = {"int0": "e", "int": "e", "frac": "e"}
_SIGN_NEXT = {"e": "esign"}
_NUM_TERMINAL = frozenset({"int0", "int", "frac", "exp"})


class JsonValueScanner:
    """Scans one strict (RFC 8259) JSON value incrementally.

    ``feed(text, pos)`` consumes ``text[pos:]`` and returns the index just past the value when
    it ends inside this text, or -1 when it needs more. A scalar at the top level (a number)
    only ends when a character that cannot continue it arrives; that character is not
    consumed. Raises `JsonScanError` at the first character that cannot continue the value.

    With ``collect``, the consumed characters are appended to ``out`` (leading whitespace at
    the top level excluded), except that raw control characters inside strings, which strict
    JSON forbids but models do write, are replaced by their escapes: the collected text is
    then always a valid JSON prefix, and a complete value is valid strict JSON.
    """

    def __init__(self, *, collect: bool = False, require_object: bool = False) -> None:
        self.out: list[str] = []
        self._collect = collect
        self._require_object = require_object
        self._stack: list[str] = []  # open containers: "{" or "["
        self._state = _S.VALUE
        self._string_is_key = False
        self._hex_left = 0
        self._number = ""  # the DFA state while in a number
        self._literal = ""  # characters of the literal still expected
        self._mark = 0  # in feed: text from here to pos is consumed but not yet in out

    def take_output(self) -> str:
        """The collected text since the last call, cleared."""
        text = "".join(self.out)
        self.out.clear()
        return text

    def feed(self, text: str, pos: int) -> int:
        # One step per state (`_STEPS`) handles text[pos], which exists, and returns the next
        # position. A step that raises has consumed nothing, so on an error the collected text
        # ends just before the offending character. Consumed text from self._mark to pos is
        # not yet copied to out.
        self._mark = pos
        n = len(text)
        steps = self._STEPS
        try:
            while pos < n:
                pos = steps[self._state](self, text, pos)
                if self._state is _S.END:
                    return pos
            return -1
        finally:
            if self._collect and pos > self._mark:
                self.out.append(text[self._mark : pos])

    # -- the steps: one per state ----------------------------------------------------------

    def _step_value(self, text: str, pos: int) -> int:
        if text[pos] in WHITESPACE:
            pos = skip_ws(text, pos)
            if not self._stack:
                self._mark = pos  # leading whitespace is not part of the value
            return pos
        return self._start_value(text, pos)

    def _step_array_first(self, text: str, pos: int) -> int:
        ch = text[pos]
        if ch in WHITESPACE:
            return skip_ws(text, pos)
        if ch == "]":
            return self._close(pos)
        return self._start_value(text, pos)  # refuses "}"

    def _step_object_first(self, text: str, pos: int) -> int:
        if text[pos] == "}":
            return self._close(pos)
        return self._step_key(text, pos)

    def _step_key(self, text: str, pos: int) -> int:
        ch = text[pos]
        if ch in WHITESPACE:
            return skip_ws(text, pos)
        if ch != '"':
            raise JsonScanError(pos)
        self._state, self._string_is_key = _S.STRING, True
        return pos + 1

    def _step_colon(self, text: str, pos: int) -> int:
        ch = text[pos]
        if ch in WHITESPACE:
            return skip_ws(text, pos)
        if ch != ":":
            raise JsonScanError(pos)
        self._state = _S.VALUE
        return pos + 1

    def _step_after_value(self, text: str, pos: int) -> int:
        ch = text[pos]
        if ch in WHITESPACE:
            return skip_ws(text, pos)
        in_object = self._stack[-1] == "{"
        if ch == ",":
            self._state = _S.KEY if in_object else _S.VALUE
            return pos + 1
        if ch != ("}" if in_object else "]"):
            raise JsonScanError(pos)
        return self._close(pos)

    def _step_string(self, text: str, pos: int) -> int:
        run = _STRING_RUN.match(text, pos)
        if run:
            pos = run.end()
            if pos == len(text):
                return pos
        ch = text[pos]  # what stopped the run
        if ch == '"':
            if self._string_is_key:
                self._state = _S.COLON
                return pos + 1
            return self._end_value(pos + 1)
        if ch == "\\":
            self._state = _S.ESCAPE
            return pos + 1
        # A raw control character: kept, escaped.
        if self._collect:
            self.out.append(text[self._mark : pos])
            self.out.append(_SHORT_ESCAPES.get(ch) or f"\\u{ord(ch):04x}")
        self._mark = pos + 1
        return pos + 1

    def _step_escape(self, text: str, pos: int) -> int:
        ch = text[pos]
        if ch == "u":
            self._state, self._hex_left = _S.UNICODE, 4
        elif ch in '"\\/bfnrt':
            self._state = _S.STRING
        else:
            raise JsonScanError(pos)
        return pos + 1

    def _step_unicode(self, text: str, pos: int) -> int:
        if text[pos] not in _HEX:
            raise JsonScanError(pos)
        self._hex_left -= 1
        if not self._hex_left:
            self._state = _S.STRING
        return pos + 1

    def _step_number(self, text: str, pos: int) -> int:
        ch = text[pos]
        if "0" <= ch <= "9":
            return self._number_digits(text, pos)
        number = self._number
        table = _DOT_NEXT if ch == "." else _EXP_NEXT if ch in "eE" else None
        if ch in "+-":
            table = _SIGN_NEXT
        if table is not None and number in table:
            self._number = table[number]
            return pos + 1
        if table is None and number in _NUM_TERMINAL:
            # The number ended just before this character, which is not consumed.
            return self._end_value(pos)
        raise JsonScanError(pos)

    def _number_digits(self, text: str, pos: int) -> int:
        """A run of digits from text[pos], a digit, in a number."""
        number = self._number
        if number == "minus" and text[pos] == "0":
            self._number = "int0"
            return pos + 1
        if number not in _DIGIT_NEXT:  # a digit after a leading 0
            raise JsonScanError(pos)
        self._number = _DIGIT_NEXT[number]
        digits = _DIGITS.match(text, pos)
        assert digits is not None  # text[pos] is a digit
        return digits.end()

    def _step_literal(self, text: str, pos: int) -> int:
        if text[pos] != self._literal[0]:
            raise JsonScanError(pos)
        self._literal = self._literal[1:]
        if self._literal:
            return pos + 1
        return self._end_value(pos + 1)

    # The state -> step table (plain functions: `feed` passes self), read once per step.
    _STEPS: ClassVar[dict[_S, Callable[[JsonValueScanner, str, int], int]]] = {
        _S.VALUE: _step_value,
        _S.ARRAY_FIRST: _step_array_first,
        _S.OBJECT_FIRST: _step_object_first,
        _S.KEY: _step_key,
        _S.COLON: _step_colon,
        _S.AFTER_VALUE: _step_after_value,
        _S.STRING: _step_string,
        _S.ESCAPE: _step_escape,
        _S.UNICODE: _step_unicode,
        _S.NUMBER: _step_number,
        _S.LITERAL: _step_literal,
    }

    # -- transitions shared by the steps ---------------------------------------------------

    def _start_value(self, text: str, pos: int) -> int:
        ch = text[pos]
        if self._require_object and not self._stack and ch != "{":
            raise JsonScanError(pos)
        if ch in "{[":
            if len(self._stack) >= MAX_JSON_DEPTH:
                raise JsonScanError(pos)
            self._stack.append(ch)
            self._state = _S.OBJECT_FIRST if ch == "{" else _S.ARRAY_FIRST
        elif ch == '"':
            self._state, self._string_is_key = _S.STRING, False
        elif ch == "-" or ("0" <= ch <= "9"):
            self._state = _S.NUMBER
            self._number = "minus" if ch == "-" else "int0" if ch == "0" else "int"
        elif ch in "tfn":
            self._state = _S.LITERAL
            self._literal = {"t": "rue", "f": "alse", "n": "ull"}[ch]
        else:
            raise JsonScanError(pos)
        return pos + 1

    def _close(self, pos: int) -> int:
        """text[pos] closes the innermost container."""
        self._stack.pop()
        return self._end_value(pos + 1)

    def _end_value(self, pos: int) -> int:
        """A value ended just before ``pos``: the top-level one ends the scan (END); after an
        inner one, its container's "," or closing bracket comes next."""
        self._state = _S.AFTER_VALUE if self._stack else _S.END
        return pos
