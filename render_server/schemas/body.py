"""Checks of a whole decoded JSON body, run before any of its fields is validated.

Free-form fields (`chat_template_kwargs`, `documents`, extra message keys, tool
parameter schemas) take any JSON, and what later walks them (the chat template's
argument copy, JSON encoders) recurses: a body a few hundred levels deep ends in a
RecursionError. JSON can also spell a lone UTF-16 surrogate (`"\\ud800"`), which Python
decodes into a str that no tokenizer or UTF-8 encoder accepts. `JsonBody` refuses both,
once, for every field of a request, as a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays in a request body, the body itself being level
1: far beyond any real tool schema or template argument, far below the recursion limit."""

# A path in the body as a linked list (parent, key): one small tuple per container, and
# the dotted path is only spelled out when something is wrong.
_Path = tuple["_Path", str | int] | None

_PARAM_PARTS = 8
_PARAM_PART_CHARS = 64
# Types a list may hold without being looked into (token ids, numbers).
_SCALARS = frozenset({int, float, bool, type(None)})


def _has_surrogate(text: str) -> bool:
    """For non-ASCII text (callers skip ASCII): surrogates are what strict UTF-8 refuses."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _param(path: _Path, key: str | int, max_parts: int) -> str:
    """The dotted field path (`messages.0.content`), its parts shortened and made
    printable: it goes into the error body, which must encode whatever the key was."""
    parts = [key]
    while path is not None:
        path, part = path
        parts.append(part)
    parts.reverse()
    shown = []
    for part in parts[:max_parts]:
        text = str(part)[:_PARAM_PART_CHARS]
        shown.append(text.encode("utf-8", "backslashreplace").decode())
    return ".".join(shown)


def check_json_body(body: dict[str, Any]) -> None:
    """Raise a PydanticCustomError naming the first field that nests deeper than
    MAX_JSON_DEPTH or holds a lone surrogate (in a key or a string)."""
    # Iterative: a recursive walk would fail on the very input it guards against.
    stack: list[tuple[dict[str, Any] | list[Any], int, _Path]] = [(body, 1, None)]
    while stack:
        node, depth, path = stack.pop()
        if type(node) is dict:
            items: Any = node.items()
        elif _SCALARS.issuperset(map(type, node)):
            continue  # a list of numbers: checked at C speed, nothing to look into
        else:
            items = enumerate(node)
        for key, value in items:
            kind = type(value)
            if (kind is str and not value.isascii() and _has_surrogate(value)) or (
                type(key) is str and not key.isascii() and _has_surrogate(key)
            ):
                raise PydanticCustomError(
                    "lone_surrogate",
                    "contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                    "valid Unicode text.",
                    {"param": _param(path, key, _PARAM_PARTS)},
                )
            if kind is dict or kind is list:
                if depth >= MAX_JSON_DEPTH:
                    raise PydanticCustomError(
                        "json_too_deep",
                        "objects and arrays nest deeper than {limit} levels.",
                        # The first parts name the field; the rest is the nesting itself.
                        {"param": _param(path, key, 4), "limit": MAX_JSON_DEPTH},
                    )
                stack.append((value, depth + 1, (path, key)))


class JsonBody(BaseModel):
    """Base of request bodies: `check_json_body` runs on the decoded JSON first.

    Only top-level bodies derive from it, so a body is walked once, not once per nested
    model."""

    @model_validator(mode="before")
    @classmethod
    def _check_json(cls, data: Any) -> Any:
        if type(data) is dict:  # anything else fails as "not an object" right after
            check_json_body(data)
        return data
