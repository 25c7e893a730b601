"""Name -> class registries for the pluggable parsers (tool calls, reasoning)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """No entry has this name; the message lists those that exist."""

    def __str__(self) -> str:  # KeyError would print the message quoted, as a repr
        return str(self.args[0])


def lookup(registry: Mapping[str, T], name: str, what: str, error: type[UnknownNameError]) -> T:
    """`registry[name]`, or `error` naming `what` was asked for and what is known."""
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise error(f"unknown {what} {name!r}; known parsers: {known}") from None
