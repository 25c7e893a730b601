"""Tool choice: what a chat request's `tools` / `tool_choice` mean for generation.

- `none`: tools may still be shown to the template, but the output is plain content.
- `auto`: the model decides; its text goes through the tool-call parser. With
  `--tool-call-parser` this needs `--enable-auto-tool-choice`, as in vLLM; without it the
  template decides (`tool_setup`), so a server started with no flags serves tools.
- `required` and a named function are enforced with a structured-output constraint, so
  they work even with a small model: a named function constrains the output to that
  function's arguments (a JSON object per its schema, where an object admits unlisted
  keys only when it says so: `_parameters`); `required` constrains it to a JSON
  array of `{"name", "parameters"}` calls of the offered tools (one call when
  `parallel_tool_calls` is false). The server turns that JSON into `tool_calls`, whatever
  the model's native format (`constrained_calls` reads it).
"""

from __future__ import annotations

import functools
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

from render_server.parsing.tool_parsers import TOOL_PARSERS, get_tool_parser
from render_server.schemas.errors import ApiError
from shared.json_schema import close_objects, has_refs, rebase_refs
from shared.protocol import Constraint

ToolMode = Literal["none", "auto", "required", "named"]
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolSetup:
    """How this server serves tools: which parser reads a model's own calls, whether the
    model may choose to call (tool_choice "auto"), and whether tool requests render with
    duet's built-in tools template instead of the chat template."""

    parser_name: str | None
    allows_auto: bool
    uses_builtin_template: bool


def template_tool_parser(template: str | None) -> str | None:
    """The parser for the call format a chat template asks the model for, if it is one a
    parser knows (by the parser's `template_marker`)."""
    for name, parser in TOOL_PARSERS.items():
        if template and parser.template_marker and parser.template_marker in template:
            return name
    return None


@functools.lru_cache(maxsize=8)  # called per request, with the same arguments every time
def tool_setup(
    *,
    tool_call_parser: str | None,
    enable_auto_tool_choice: bool,
    chat_template: str | None,
    builtin_template: str | None,
    family_tool_parser: str | None = None,
) -> ToolSetup:
    """What the operator's flags and the templates mean for tools.

    `chat_template` is the template chats render with (`--chat-template` or the model's);
    `builtin_template` is duet's tools template when the model's own shows no tools (and
    no `--chat-template` replaced it), else None. A `--tool-call-parser` keeps vLLM's
    meaning: that parser, and "auto" only with `--enable-auto-tool-choice`; the built-in
    template is then used only when it writes that parser's format. Without one, the
    template tool requests render with decides the parser, else the model family's
    (`family_tool_parser`, from `family_defaults`), and "auto" is allowed when either
    names one.
    """
    if tool_call_parser is not None:
        agrees = template_tool_parser(builtin_template) == tool_call_parser
        return ToolSetup(tool_call_parser, enable_auto_tool_choice, agrees)
    parser = template_tool_parser(builtin_template or chat_template) or family_tool_parser
    return ToolSetup(parser, parser is not None, builtin_template is not None)


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
    """The arguments schema the output is held to: the tool's, with every object that does
    not say `additionalProperties` closed (`shared.json_schema.close_objects`), as OpenAI's
    strict mode reads it. Open, a schema that leaves it out (most do) lets a model add keys
    until max_tokens; an object that allows them explicitly keeps them."""
    parameters = tool["function"].get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        parameters = {"type": "object"}
    try:
        return close_objects(parameters, bare_objects=True)
    except ValueError as exc:
        name = tool["function"]["name"]
        raise ApiError(400, f"tools: {name}'s parameters: {exc}.", param="tools") from None


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
        return ToolPlan(
            "required", tools, constraint=_required_constraint(tools, parallel_tool_calls)
        )
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


def _required_constraint(
    tools: list[dict[str, Any]], parallel_tool_calls: bool | None
) -> Constraint:
    """One or more calls (one when `parallel_tool_calls` is false), each of a listed tool
    with its arguments. A tool whose parameters use `$ref` moves them into the root's
    `$defs`, its refs rebased, since "#/..." now names the root of this array schema."""
    items, defs = [], {}
    for index, tool in enumerate(tools):
        parameters = _parameters(tool)
        if has_refs(parameters):
            key = f"tool{index}"
            defs[key] = rebase_refs(parameters, f"#/$defs/{key}")
            parameters = {"$ref": f"#/$defs/{key}"}
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return _schema_constraint(schema)


def _schema_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint(kind="json_schema", spec=json.dumps(schema))


def check_parser_name(name: str | None) -> None:
    """Fail at startup on an unknown --tool-call-parser."""
    if name is not None:
        get_tool_parser(name)
