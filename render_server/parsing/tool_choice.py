"""Tool choice: what a chat request's `tools` / `tool_choice` mean for generation.

- `none`: tools may still be shown to the template, but the output is plain content.
- `auto`: the model decides; its text goes through the `--tool-call-parser` (needs
  `--enable-auto-tool-choice`, as in vLLM).
- `required` and a named function are enforced with a structured-output constraint, so
  they work even with a small model: a named function constrains the output to that
  function's arguments (a JSON object per its schema); `required` constrains it to a JSON
  array of `{"name", "parameters"}` calls of the offered tools (one call when
  `parallel_tool_calls` is false). The server turns that JSON into `tool_calls`, whatever
  the model's native format.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

from render_server.parsing.tool_parsers import ToolCall, get_tool_parser
from render_server.schemas.errors import ApiError
from shared.protocol import Constraint

ToolMode = Literal["none", "auto", "required", "named"]
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools."""

    mode: ToolMode
    tools: list[dict[str, Any]] | None
    """The OpenAI tool definitions, as the chat template and the parser see them."""
    parser_name: str | None = None
    """For `auto`: the tool-call parser that reads the model's text."""
    function_name: str | None = None
    """For a named tool choice."""
    constraint: Constraint | None = None
    """For `required` / named: what the worker must keep the output inside."""


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
) -> ToolPlan:
    """Check the request's tool fields and decide how to serve them (400 when invalid)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs `tools`.", param="tool_choice")
        return ToolPlan("none", None)
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique.", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise ApiError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser NAME; use tool_choice "required" or a named function.',
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parser_name=tool_call_parser)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=_schema_constraint(schema))
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        for tool in tools:
            if tool["function"]["name"] == name:
                return ToolPlan(
                    "named",
                    tools,
                    function_name=name,
                    constraint=_schema_constraint(_parameters(tool)),
                )
        raise ApiError(
            400, f"tool_choice names {name!r}, which is not in tools.", param="tool_choice"
        )
    raise ApiError(
        400,
        'tool_choice must be "none", "auto", "required" or {"type": "function", '
        '"function": {"name": ...}}.',
        param="tool_choice",
    )


def _schema_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint(kind="json_schema", spec=json.dumps(schema))


def calls_from_constrained_text(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The tool calls in the text of a `required` / named generation.

    The constraint makes the text valid JSON of the right shape unless generation was cut
    short (max_tokens); then no call is reported and the text stays content."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if plan.mode == "named":
        if not isinstance(value, dict):
            return []
        return [ToolCall(new_call_id(), plan.function_name or "", text.strip())]
    if not isinstance(value, list):
        return []
    return [
        ToolCall(new_call_id(), call["name"], json.dumps(call["parameters"], ensure_ascii=False))
        for call in value
        if isinstance(call, dict) and "name" in call and "parameters" in call
    ]


def check_parser_name(name: str | None) -> None:
    """Fail at startup on an unknown --tool-call-parser."""
    if name is not None:
        get_tool_parser(name)
