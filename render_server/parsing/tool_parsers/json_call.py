"""Reading one JSON call object, ``{"name": "f", "arguments": {...}}``, a chunk at a time.

Shared by the JSON formats (hermes, llama3_json, mistral's array shape): it announces the call
as soon as it is certain and streams the arguments' characters as they are scanned.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum

from render_server.parsing.tool_parsers.base import Status
from render_server.parsing.tool_parsers.json_scan import (
    SIMPLE_STRING,
    JsonScanError,
    JsonValueScanner,
    skip_ws,
)


class _R(Enum):
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


class JsonCallReader:
    """Reads one call object, ``{"name": "f", "arguments": {...}}``, a chunk at a time.

    The call is announced (``commit(name)``) once the name is a known tool and its arguments
    object has begun, then the arguments' characters are streamed (``emit_args``) as they are
    scanned. When "name" comes after the arguments, the arguments are held until the object
    closes. Members other than the name and the arguments are checked and ignored; a missing
    arguments member means ``{}``. Before the commit, a failure means the text was not a call;
    after it, the call stands with the arguments sent so far (``committed`` tells which).
    """

    def __init__(
        self,
        is_known: Callable[[str], bool],
        commit: Callable[[str], None],
        emit_args: Callable[[str], None],
        args_keys: tuple[str, ...] = ("arguments", "parameters"),
    ) -> None:
        self._is_known = is_known
        self._commit = commit
        self._emit_args = emit_args
        self._args_keys = args_keys
        self._state = _R.OPEN
        self._scanner: JsonValueScanner | None = None
        self._key = ""
        self._name: str | None = None
        self._held_args: str | None = None  # arguments seen before the name
        self._seen_args = False
        self.committed = False

    def feed(self, text: str, pos: int) -> tuple[int, Status]:
        n = len(text)
        while True:
            if self._scanner is not None:
                try:
                    end = self._scanner.feed(text, pos)
                except JsonScanError as exc:
                    self._drain_args()
                    return exc.pos, Status.FAILED
                self._drain_args()
                if end < 0:
                    return n, Status.NEED_MORE
                pos = end
                if not self._value_done():
                    return pos, Status.FAILED
                continue
            pos = skip_ws(text, pos)
            if pos >= n:
                return n, Status.NEED_MORE
            ch = text[pos]
            state = self._state
            if state is _R.OPEN:
                if ch != "{":
                    return pos, Status.FAILED
                self._state = _R.FIRST_KEY
                pos += 1
            elif ch == "}" and state in (_R.FIRST_KEY, _R.NEXT):
                if not self._close():
                    return pos, Status.FAILED
                return pos + 1, Status.DONE
            elif state in (_R.FIRST_KEY, _R.KEY):
                if ch != '"':
                    return pos, Status.FAILED
                simple = SIMPLE_STRING.match(text, pos)
                if simple:  # the common case, without a scanner
                    self._key, self._state = simple.group(1), _R.COLON
                    pos = simple.end()
                else:
                    self._state = _R.IN_KEY
                    self._scanner = JsonValueScanner(collect=True)
            elif state is _R.COLON:
                if ch != ":":
                    return pos, Status.FAILED
                self._state = _R.VALUE
                pos += 1
            elif state is _R.VALUE:
                simple = SIMPLE_STRING.match(text, pos) if self._key == "name" else None
                if simple and self._name is None:  # the common case, without a scanner
                    self._name, self._state = simple.group(1), _R.NEXT
                    pos = simple.end()
                    if not self._name_is_ok():
                        return pos, Status.FAILED
                elif not self._start_member_value(ch):
                    return pos, Status.FAILED
            else:  # _R.NEXT
                if ch != ",":
                    return pos, Status.FAILED
                self._state = _R.KEY
                pos += 1

    def _start_member_value(self, ch: str) -> bool:
        if self._key == "name":
            if self._name is not None or ch != '"':
                return False
            self._state = _R.IN_NAME
            self._scanner = JsonValueScanner(collect=True)
        elif self._key in self._args_keys:
            if self._seen_args or ch != "{":
                return False
            self._seen_args = True
            self._state = _R.IN_ARGS
            self._scanner = JsonValueScanner(collect=True, require_object=True)
            if self._name is not None:
                self._commit_now()
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
        elif self._state is _R.IN_ARGS and not self.committed:
            self._held_args = scanner.take_output()
        self._state = _R.NEXT
        return True

    def _name_is_ok(self) -> bool:
        assert self._name is not None
        return self._is_known(self._name)

    def _close(self) -> bool:
        """The object closed: commit now if the name came last or there were no arguments."""
        if self._name is None:
            return False
        if not self.committed:
            self._commit_now()
            self._emit_args(self._held_args if self._held_args is not None else "{}")
        return True

    def _commit_now(self) -> None:
        assert self._name is not None
        self.committed = True
        self._commit(self._name)

    def _drain_args(self) -> None:
        if self._state is _R.IN_ARGS and self.committed and self._scanner is not None:
            text = self._scanner.take_output()
            if text:
                self._emit_args(text)
