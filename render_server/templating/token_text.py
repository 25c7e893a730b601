"""Per-token text and bytes, as OpenAI's logprobs report them.

A byte-level BPE token can be part of a UTF-8 character, so its text alone cannot say what
it is; the `bytes` field carries the token's raw bytes. Both are cached per token id: a
logprobs response asks for the same few thousand ids over and over.
"""

from __future__ import annotations

from functools import lru_cache

from render_server.templating.tokenizer import Tokenizer
from shared.byte_level import unicode_to_bytes

_BYTE_OF_CHAR = unicode_to_bytes()


class TokenText:
    """Cached `(text, bytes)` of single token ids for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 65536) -> None:
        self._tokenizer = tokenizer
        self.lookup = lru_cache(maxsize=cache_size)(self._compute)

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        hf = self._tokenizer.hf
        text = hf.decode([token_id], skip_special_tokens=False)
        piece = hf.id_to_token(token_id)
        if piece is not None and token_id not in self._special_ids():
            raw = [_BYTE_OF_CHAR[char] for char in piece if char in _BYTE_OF_CHAR]
            if len(raw) == len(piece):  # every character is one of the 256 byte characters
                return text, raw
        return text, list(text.encode("utf-8"))

    @lru_cache(maxsize=1)  # noqa: B019 - one instance per app, lives as long as it
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.hf.get_added_tokens_decoder())
