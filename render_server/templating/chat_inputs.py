"""A chat request's data as a template takes it: plain JSON types only, messages shaped the
way Hugging Face templates expect them, and transformers' marker for continue_final_message.

OpenAI clients and HF templates disagree on a few shapes (tool-call arguments as a JSON
string, content as a list of parts), so messages are normalized here as transformers and
vLLM do before any template sees them; what the template renders for a continued final
message is cut where transformers cuts it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import jinja2.nodes

from render_server.templating.errors import ChatTemplateError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, so the cut matches
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PLAIN_SCALARS = frozenset({str, int, float, bool, type(None)})


def iterates_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template loops over message content, i.e. takes OpenAI-style content parts.
    Templates that only concatenate content get the text parts joined into a string instead."""
    aliases: set[str] = set()
    for assign in ast.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _mentions_content(assign.node, set()):
            aliases.add(assign.target.name)
    return any(_mentions_content(loop.iter, aliases) for loop in ast.find_all(jinja2.nodes.For))


def _mentions_content(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
    kinds = (jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Name)
    for n in [node, *node.find_all(kinds)]:
        key = getattr(n.arg, "value", None) if isinstance(n, jinja2.nodes.Getitem) else None
        key = getattr(n, "attr", key)
        if key == "content" or (isinstance(n, jinja2.nodes.Name) and n.name in aliases):
            return True
    return False


def plain(value: Any) -> Any:
    """Rebuild request data from plain JSON types, so no object with methods reaches a template."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return value
    if kind is dict:  # the common case, ahead of the slower ABC checks below
        return {plain(key): plain(item) for key, item in value.items()}
    if kind is list:
        return [plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return f"<{type(value).__name__}>"


def fits_inline(values: Iterable[Any], budget: int) -> bool:
    """Whether the request data holds at most `budget` characters (strings, keys included,
    plus one per value); stops counting as soon as it is over."""
    stack = list(values)
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is str:
            budget -= len(value)
        elif kind is dict or (kind is not list and isinstance(value, Mapping)):
            budget -= len(value)
            stack.extend(value.keys())
            stack.extend(value.values())
        elif kind is list or isinstance(value, list | tuple):
            budget -= len(value)
            stack.extend(value)
        elif isinstance(value, str):
            budget -= len(value)
        if budget < 0:
            return False
    return True


def has_tool_turns(messages: Any) -> bool:
    """Whether a chat holds tool calls or tool results, which only a template that shows
    tools renders faithfully."""
    return isinstance(messages, list) and any(
        isinstance(message, Mapping)
        and (message.get("role") == "tool" or message.get("tool_calls"))
        for message in messages
    )


def prepare_messages(messages: Any, content_parts: bool) -> list[dict[str, Any]]:
    """transformers' normalization (drop None values, alias reasoning fields), then the
    OpenAI-to-HF fixes: tool-call arguments as objects, and text parts joined into a string
    for templates that treat content as a string."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    prepared = []
    for message in messages:
        if type(message) is not dict and not isinstance(message, Mapping):
            raise ChatTemplateError("each message must be an object")
        message = {plain(key): plain(value) for key, value in message.items() if value is not None}
        reasoning = None
        for field in _REASONING_FIELDS:
            if field in message:
                reasoning = message[field]
                break
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if not content_parts and type(message.get("content")) is list:
            message["content"] = _flatten_content(message["content"])
        if message.get("tool_calls"):
            _parse_tool_arguments(message)
        prepared.append(message)
    return prepared


def _flatten_content(content: list[Any]) -> str:
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text":
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError("a text content part needs a string 'text'")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"content parts of type {kind!r} are not supported")
    return "\n".join(texts)


def _parse_tool_arguments(message: dict[str, Any]) -> None:
    """OpenAI sends tool-call arguments as a JSON string; HF templates expect the object
    (they `tojson` it), so a string that parses to an object is replaced by it, as vLLM does."""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue  # malformed model output: render it as the string it is
            if isinstance(parsed, dict):
                function["arguments"] = parsed


def tag_final_message(chat: list[dict[str, Any]]) -> str:
    """Append transformers' marker to the final message's text; returns that text."""
    content = chat[-1].get("content")
    if isinstance(content, str):
        chat[-1]["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
    raise ChatTemplateError("continue_final_message needs a final message with text content")


def cut_after_final_message(text: str, final_text: str) -> str:
    """The rendered `text` up to where the final message (tagged by `tag_final_message`,
    its text `final_text`) ends, so generation continues it."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the final message as given"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message, so trim our cut the same way
