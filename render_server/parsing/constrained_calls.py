"""The tool calls in the output of a `required` / named tool choice, as they complete.

The constraint (`tool_choice.plan_tools`) keeps the output inside its JSON shape, so the
only way it can end early is a cut (max_tokens): then the calls completed so far are the
answer and the unfinished one is dropped, streamed or not, never left in `content` as raw
JSON. Each call is sent whole once its JSON closes, as the tool parsers send theirs; that
way a stream never commits to arguments a cut would leave broken.

- named: the whole output is the arguments object of the named function;
- required: the output is `[{"name": ..., "parameters": {...}}, ...]`.
"""

from __future__ import annotations

from render_server.parsing.tool_choice import ToolPlan, new_call_id
from render_server.parsing.tool_parsers import ToolCall
from render_server.parsing.tool_parsers.base import Status
from render_server.parsing.tool_parsers.json_call import JsonCallReader
from render_server.parsing.tool_parsers.json_scan import (
    JsonScanError,
    JsonValueScanner,
    StateEnum,
    skip_ws,
)


class _At(StateEnum):
    OPEN = 1  # before the array's "["
    ELEMENT = 2  # a call's "{", or "]"
    CALL = 3  # inside a call's JSON
    NEXT = 4  # "," or "]"
    DONE = 5  # nothing after this is read


class ConstrainedCallReader:
    """Reads one choice's constrained output a piece at a time; `feed` returns the calls
    that completed in that piece."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.mode in ("named", "required")
        self._function_name = plan.function_name if plan.mode == "named" else None
        self._names = frozenset(tool["function"]["name"] for tool in plan.tools or ())
        self._arguments: JsonValueScanner | None = None  # named
        self._call: JsonCallReader | None = None  # required
        if self._function_name is not None:
            self._arguments = JsonValueScanner(collect=True, require_object=True)
            self._state = _At.CALL
        else:
            self._state = _At.OPEN

    def feed(self, text: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        pos, n = 0, len(text)
        while pos < n and self._state is not _At.DONE:
            if self._state is _At.CALL:
                pos = self._read_call(text, pos, calls)
                continue
            pos = skip_ws(text, pos)
            if pos < n:
                pos = self._step(text[pos], pos)
        return calls

    def _step(self, ch: str, pos: int) -> int:
        """One structural character of the array (the constraint admits no other)."""
        state = self._state
        if state is _At.OPEN and ch == "[":
            self._state = _At.ELEMENT
        elif state is _At.ELEMENT and ch == "{":
            self._call = JsonCallReader(self._names.__contains__, args_keys=("parameters",))
            self._state = _At.CALL
            return pos  # the reader reads the object from its "{"
        elif state is _At.NEXT and ch == ",":
            self._state = _At.ELEMENT
        else:  # "]", or text the constraint should not have let through
            self._state = _At.DONE
        return pos + 1

    def _read_call(self, text: str, pos: int, calls: list[ToolCall]) -> int:
        if self._arguments is not None:
            return self._read_arguments(text, pos, calls)
        assert self._call is not None
        pos, status = self._call.feed(text, pos)
        if status is Status.DONE:
            calls.append(ToolCall(new_call_id(), *self._call.call))
            self._state = _At.NEXT
        elif status is Status.FAILED:
            self._state = _At.DONE
        return pos

    def _read_arguments(self, text: str, pos: int, calls: list[ToolCall]) -> int:
        assert self._arguments is not None and self._function_name is not None
        try:
            end = self._arguments.feed(text, pos)
        except JsonScanError:
            end = -1
            self._state = _At.DONE
        if end < 0:
            return len(text)
        arguments = self._arguments.take_output()
        calls.append(ToolCall(new_call_id(), self._function_name, arguments))
        self._state = _At.DONE
        return end
