"""One chat choice's text -> reasoning, content and tool calls, streamed or whole.

Per choice: the `--reasoning-parser` (if any) splits reasoning from the answer first;
tool handling applies only to the answer, after reasoning ended. In `auto` mode the
tool-call parser reads the answer; with a named tool choice or `required` the
(constrained) answer is JSON read by `constrained_calls`. Either way a call is sent whole
once it is well formed. The non-streamed result is the streamed one accumulated, so both
always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from render_server.parsing.constrained_calls import ConstrainedCallReader
from render_server.parsing.reasoning import get_reasoning_parser
from render_server.parsing.tool_choice import ToolPlan, new_call_id
from render_server.parsing.tool_parsers import ToolCall, get_tool_parser
from render_server.schemas.responses import (
    FunctionDeltaOut,
    FunctionOut,
    ToolCallDeltaOut,
    ToolCallOut,
)


@dataclass
class ChoicePiece:
    """What one delta of a choice adds, in the client's terms."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.reasoning and not self.content and not self.tool_calls

    def then(self, later: ChoicePiece) -> ChoicePiece:
        """This piece followed by `later`, as one."""
        return ChoicePiece(
            _join(self.reasoning, later.reasoning),
            _join(self.content, later.content),
            self.tool_calls + later.tool_calls,
        )


@dataclass
class ChoiceResult:
    """A whole choice: what the non-streamed message holds."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCallOut]


def _join(a: str | None, b: str | None) -> str | None:
    if not b:
        return a
    return b if a is None else a + b


class ChoiceProcessor:
    """Stateful splitter for one choice; feed it the detokenized text as it streams."""

    def __init__(
        self,
        plan: ToolPlan,
        reasoning_parser: str | None = None,
        *,
        enable_thinking: bool = True,
    ) -> None:
        self.plan = plan
        self._reasoning = (
            get_reasoning_parser(reasoning_parser)(enable_thinking=enable_thinking)
            if reasoning_parser is not None
            else None
        )
        self._tools = (
            get_tool_parser(plan.parser_name)(plan.tools)
            if plan.mode == "auto" and plan.parser_name is not None
            else None
        )
        self._constrained = (
            ConstrainedCallReader(plan) if plan.mode in ("named", "required") else None
        )
        self._num_calls = 0  # calls sent so far
        self.called_tools = False
        """Some tool call was emitted: the choice's finish_reason becomes "tool_calls"."""

    def feed(self, text: str) -> ChoicePiece:
        """What `text`, the choice's next detokenized text, adds."""
        if not text:
            return ChoicePiece()
        if self._reasoning is None:
            return self._answer(text)
        reasoning, content = self._reasoning.feed(text)
        piece = self._answer(content) if content else ChoicePiece()
        piece.reasoning = reasoning or None
        return piece

    def feed_last(self, text: str) -> ChoicePiece:
        """What the choice's last text adds, with everything held back until its end."""
        return self.feed(text).then(self.finish())

    def finish(self) -> ChoicePiece:
        """The end of the choice: release what the parsers held back."""
        piece = ChoicePiece()
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
            piece.reasoning = reasoning or None
            if content:
                piece = piece.then(self._answer(content))
        return piece.then(self._finish_answer())

    def _answer(self, text: str) -> ChoicePiece:
        if self._tools is not None:
            message = self._tools.feed(text)
            return ChoicePiece(content=message.content, tool_calls=self._deltas(message.tool_calls))
        if self._constrained is not None:
            return ChoicePiece(tool_calls=self._deltas(self._constrained.feed(text)))
        return ChoicePiece(content=text)

    def _finish_answer(self) -> ChoicePiece:
        # A constrained answer cut short holds only an unfinished call: nothing to release.
        if self._tools is None:
            return ChoicePiece()
        message = self._tools.finish()
        return ChoicePiece(content=message.content, tool_calls=self._deltas(message.tool_calls))

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDeltaOut]:
        """Whole calls, each in one delta, numbered across the choice."""
        out = []
        for call in calls:
            function = FunctionDeltaOut(call.name, call.arguments)
            out.append(ToolCallDeltaOut(self._num_calls, call.id, "function", function))
            self._num_calls += 1
            self.called_tools = True
        return out

    def whole(self, text: str) -> ChoiceResult:
        """The non-streamed result: the streamed pieces of `text`, accumulated."""
        total = self.feed_last(text)
        calls: dict[int, ToolCallOut] = {}
        for delta in total.tool_calls:
            function = delta.function or FunctionDeltaOut()
            call = calls.get(delta.index)
            if call is None:
                calls[delta.index] = ToolCallOut(
                    delta.id or new_call_id(),
                    FunctionOut(function.name or "", function.arguments or ""),
                )
            else:
                call.function.arguments += function.arguments or ""
        content = total.content
        if calls and content is not None and not content.strip():
            content = None
        return ChoiceResult(total.reasoning, content, [calls[i] for i in sorted(calls)])
