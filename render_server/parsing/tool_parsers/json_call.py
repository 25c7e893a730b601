"""Reading one JSON call object, ``{"name": "f", "arguments": {...}}``, a chunk at a time.

Shared by the JSON formats (hermes, llama3_json, mistral's array shape): it says when the
object closes as a well-formed call, and fails at the first character that rules one out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import ClassVar

from render_server.parsing.tool_parsers.base import Status
from render_server.parsing.tool_parsers.json_scan import (
    SIMPLE_STRING,
    JsonScanError,
    JsonValueScanner,
    StateEnum,
    skip_ws,
)


class _R(StateEnum):
    OPEN = 1  # before "{"
    FIRST_KEY = 2  # after "{": a key or "}"
    KEY = 3  # after ",": a key
    IN_KEY = 4
    COLON = 5
    VALUE = 6  # before a member's value
    IN_NAME = 7
    IN_ARGS = 8
    IN_OTHER = 9  # a member the call does not use: checked and skipped
    NEXT = 10  # "," or "}"
    DONE = 11  # the object closed as a call


# What a reader's step returns: the next position, and None to go on or the Status that ends
# the feed.
_Outcome = tuple[int, Status | None]


class JsonCallReader:
    """Reads one call object, ``{"name": "f", "arguments": {...}}``, a chunk at a time.

    `feed` ends with DONE once the object closes as a well-formed call: a known tool's name,
    and an arguments object (a missing one means ``{}``); then `call` is (name, arguments).
    Members other than the name and the arguments are checked and ignored. It ends with
    FAILED at the first character that rules a well-formed call out, an unknown name as soon
    as the name is read.
    """

    def __init__(
        self,
        is_known: Callable[[str], bool],
        args_keys: tuple[str, ...] = ("arguments", "parameters"),
    ) -> None:
        self._is_known = is_known
        self._args_keys = args_keys
        self._state = _R.OPEN
        self._scanner: JsonValueScanner | None = None
        self._key = ""
        self._name: str | None = None
        self._arguments: str | None = None

    @property
    def call(self) -> tuple[str, str]:
        """The call's name and arguments text, once `feed` returned DONE."""
        assert self._name is not None and self._state is _R.DONE
        return self._name, "{}" if self._arguments is None else self._arguments

    def feed(self, text: str, pos: int) -> tuple[int, Status]:
        # Invariant: a scanner exists exactly in the IN_* states, and reads their key or value;
        # each other state takes one step (`_STEPS`) at the next non-whitespace character.
        n = len(text)
        status: Status | None = None
        while status is None:
            if self._scanner is not None:
                pos, status = self._scan_value(text, pos)
                continue
            pos = skip_ws(text, pos)
            if pos >= n:
                return n, Status.NEED_MORE
            pos, status = self._STEPS[self._state](self, text, pos)
        return pos, status

    def _scan_value(self, text: str, pos: int) -> _Outcome:
        assert self._scanner is not None
        try:
            end = self._scanner.feed(text, pos)
        except JsonScanError as exc:
            return exc.pos, Status.FAILED
        if end < 0:
            return len(text), Status.NEED_MORE
        return end, None if self._value_done() else Status.FAILED

    # -- the steps: one per state outside a scanned value ------------------------------------

    def _step_open(self, text: str, pos: int) -> _Outcome:
        if text[pos] != "{":
            return pos, Status.FAILED
        self._state = _R.FIRST_KEY
        return pos + 1, None

    def _step_first_key(self, text: str, pos: int) -> _Outcome:
        if text[pos] == "}":
            return self._close(pos)
        return self._step_key(text, pos)

    def _step_key(self, text: str, pos: int) -> _Outcome:
        if text[pos] != '"':
            return pos, Status.FAILED
        simple = SIMPLE_STRING.match(text, pos)
        if simple:  # the common case, without a scanner
            self._key, self._state = simple.group(1), _R.COLON
            return simple.end(), None
        self._state = _R.IN_KEY
        self._scanner = JsonValueScanner(collect=True)
        return pos, None

    def _step_colon(self, text: str, pos: int) -> _Outcome:
        if text[pos] != ":":
            return pos, Status.FAILED
        self._state = _R.VALUE
        return pos + 1, None

    def _step_value(self, text: str, pos: int) -> _Outcome:
        simple = SIMPLE_STRING.match(text, pos) if self._key == "name" else None
        if simple and self._name is None:  # the common case, without a scanner
            self._name, self._state = simple.group(1), _R.NEXT
            return simple.end(), None if self._name_is_ok() else Status.FAILED
        if not self._start_member_value(text[pos]):
            return pos, Status.FAILED
        return pos, None

    def _step_next(self, text: str, pos: int) -> _Outcome:
        ch = text[pos]
        if ch == "}":
            return self._close(pos)
        if ch != ",":
            return pos, Status.FAILED
        self._state = _R.KEY
        return pos + 1, None

    # The state -> step table (plain functions: `feed` passes self); IN_* have none.
    _STEPS: ClassVar[dict[_R, Callable[[JsonCallReader, str, int], _Outcome]]] = {
        _R.OPEN: _step_open,
        _R.FIRST_KEY: _step_first_key,
        _R.KEY: _step_key,
        _R.COLON: _step_colon,
        _R.VALUE: _step_value,
        _R.NEXT: _step_next,
    }

    def _start_member_value(self, ch: str) -> bool:
        if self._key == "name":
            if self._name is not None or ch != '"':
                return False
            self._state = _R.IN_NAME
            self._scanner = JsonValueScanner(collect=True)
        elif self._key in self._args_keys:
            if self._arguments is not None or ch != "{":
                return False
            self._state = _R.IN_ARGS
            self._scanner = JsonValueScanner(collect=True, require_object=True)
        else:
            self._state = _R.IN_OTHER
            self._scanner = JsonValueScanner()
        return True

    def _value_done(self) -> bool:
        """The scanned key or value ended; False when the call cannot go on."""
        scanner, self._scanner = self._scanner, None
        assert scanner is not None
        if self._state is _R.IN_KEY:
            self._key = json.loads(scanner.take_output())
            self._state = _R.COLON
            return True
        if self._state is _R.IN_NAME:
            self._name = json.loads(scanner.take_output())
            if not self._name_is_ok():
                return False
        elif self._state is _R.IN_ARGS:
            self._arguments = scanner.take_output()
        self._state = _R.NEXT
        return True

    def _name_is_ok(self) -> bool:
        assert self._name is not None
        return self._is_known(self._name)

    def _close(self, pos: int) -> tuple[int, Status]:
        """The object closes at ``pos``: a call if it named one."""
        if self._name is None:
            return pos, Status.FAILED
        self._state = _R.DONE
        return pos + 1, Status.DONE
