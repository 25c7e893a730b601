"""Special-token text inside a request's strings, kept from becoming special tokens.

A user who types "<|im_end|>" must not end the turn: before the template runs, each
special token's text in the request's strings is swapped for one private-use character
(Supplementary Private Use Area-A), and after it the rendered text is cut at those
characters, the originals encoded as plain text and the rest as usual.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from render_server.templating.errors import ChatTemplateError
from render_server.templating.tokenizer import Tokenizer

_SENTINEL_FIRST, _SENTINEL_LAST = 0xF0000, 0xFFFFD
_SENTINEL_CLASS = "[\U000f0000-\U000ffffd]"
_SENTINEL_SPLIT = re.compile(f"({_SENTINEL_CLASS})")


class SpecialTextGuard:
    """Swaps special-token text in request strings for sentinels (`protect`), and encodes a
    rendered text with each sentinel read back as its original, plain text (`encode`)."""

    def __init__(self, special_tokens: Sequence[str]) -> None:
        alternatives = "|".join(map(re.escape, sorted(special_tokens, key=len, reverse=True)))
        # User text that already holds sentinel characters is protected too, as itself.
        self._pattern = re.compile(f"{alternatives}|{_SENTINEL_CLASS}")
        # Any match starts with one of these characters. A one-class pattern scans fast,
        # where the alternation above tries every token at every position.
        first_chars = "".join(sorted({re.escape(token[0]) for token in special_tokens}))
        self._hint = re.compile(f"[{first_chars}\U000f0000-\U000ffffd]")

    @classmethod
    def for_tokens(cls, special_tokens: Sequence[str]) -> SpecialTextGuard | None:
        """A guard for the tokenizer's special tokens, or None when none needs one."""
        # Whitespace tokens (Gemma's "\n") are ordinary text in any template; never protect them.
        protected = [token for token in special_tokens if token.strip()]
        return cls(protected) if protected else None

    def protect(self, values: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, str]]:
        """Swap each special-token text in the strings of `values` (plain request data) for a
        sentinel character; returns the new values and sentinel -> original text. Values with
        nothing to protect come back as they are, with no sentinels."""
        if not _any_string_matches(values, self._needs_protection):
            return values, {}
        sentinels: dict[str, str] = {}

        def sentinel(match: re.Match[str]) -> str:
            text = match.group()
            if text not in sentinels:
                if _SENTINEL_FIRST + len(sentinels) > _SENTINEL_LAST:
                    raise ChatTemplateError("too many distinct special tokens in the request")
                sentinels[text] = chr(_SENTINEL_FIRST + len(sentinels))
            return sentinels[text]

        pattern = self._pattern
        marked = tuple(
            _map_strings(value, lambda text: pattern.sub(sentinel, text)) for value in values
        )
        return marked, {mark: text for text, mark in sentinels.items()}

    def _needs_protection(self, text: str) -> bool:
        return self._hint.search(text) is not None and self._pattern.search(text) is not None


def encode_restored(
    tokenizer: Tokenizer, text: str, by_sentinel: dict[str, str]
) -> tuple[str, list[int]]:
    """The rendered `text` with each sentinel of `by_sentinel` back as its original, and its
    token ids: the originals encoded as plain text, the pieces between them as usual."""
    pieces, token_ids = [], []
    for index, piece in enumerate(_SENTINEL_SPLIT.split(text)):
        original = by_sentinel.get(piece) if index % 2 else None
        if original is not None:
            pieces.append(original)
            token_ids += tokenizer.encode_plain(original)
        elif piece:
            pieces.append(piece)
            token_ids += tokenizer.encode_text(piece)
    return "".join(pieces), token_ids


def _any_string_matches(values: Iterable[Any], matches: Callable[[str], bool]) -> bool:
    """Whether any string value (not dict keys, as in `_map_strings`) of plain request
    data `matches`."""
    stack = list(values)
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is str:
            if matches(value):
                return True
        elif kind is dict:
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)
    return False


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """Apply `fn` to every string value (not dict keys) in plain request data."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, fn) for item in value]
    return value
