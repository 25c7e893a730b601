"""No key twice in one object of a constrained JSON output, whatever the schema says.

llguidance emits an object's listed properties once each, in order, but an object that
admits unlisted keys (`additionalProperties: true` or a schema) admits any key again: a
grammar cannot refuse "a key seen before" (that language is not context-free), so a
model could repeat one until max_tokens. `KeyGuard` follows the output's JSON byte by
byte, knowing the keys of each open object; while the output is inside a key, `refuse`
clears the mask bits of the tokens whose closing quote would complete a key the object
already holds. Only tokens holding a `"` can close a key (`QuoteTokens`, read once per
vocabulary), so the cost is a pass over those while a key is being written, none
elsewhere.

Keys are compared as written (raw JSON bytes): the same key spelled with different
escapes is not caught, a case the compact grammar makes unlikely.
"""

from __future__ import annotations

import llguidance
import numpy as np

_OUTSIDE, _KEY, _STRING = 0, 1, 2  # where the next byte lands
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


class QuoteTokens:
    """The vocabulary's tokens whose bytes hold a double quote, with those bytes."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        ids: list[int] = []
        self.texts: list[bytes] = []
        for token_id in range(tokenizer.vocab_size):
            if tokenizer.is_special_token(token_id):
                continue
            text = tokenizer.decode_bytes([token_id])
            if b'"' in text:
                ids.append(token_id)
                self.texts.append(text)
        self.ids = np.array(ids, dtype=np.int64)


class KeyGuard:
    """One output's JSON structure as far as keys go: each open container (an object's
    keys so far, or None for an array), and whether the output is inside a key."""

    def __init__(self, quote_tokens: QuoteTokens) -> None:
        self.quote_tokens = quote_tokens
        self._fed: list[bytes] = []
        """Every token's bytes fed so far: `rollback` replays all but the last few."""
        self._reset()

    def _reset(self) -> None:
        self._stack: list[set[bytes] | None] = []
        self._where = _OUTSIDE
        self._escaped = False
        self._expects_key = False  # just after an object's "{" or ","
        self._key = b""

    def copy(self) -> KeyGuard:
        """This state, to feed drafts through without changing it (no history)."""
        other = KeyGuard(self.quote_tokens)
        other._stack = [None if keys is None else set(keys) for keys in self._stack]
        other._where, other._escaped = self._where, self._escaped
        other._expects_key, other._key = self._expects_key, self._key
        return other

    @property
    def is_writing_key(self) -> bool:
        """Inside a key of an object that already holds one: a token may repeat it."""
        return self._where == _KEY and bool(self._stack and self._stack[-1])

    def would_repeat(self, text: bytes) -> bool:
        """Whether a token with these bytes would close the current key as one its object
        already holds."""
        if not self.is_writing_key:
            return False
        escaped = self._escaped
        for index, byte in enumerate(text):
            if escaped:
                escaped = False
            elif byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                keys = self._stack[-1]
                return keys is not None and self._key + text[:index] in keys
        return False

    def refuse(self, words: np.ndarray) -> None:
        """Clear, in one row of an llguidance bitmask (uint32 words, bit t = token t
        allowed), the tokens that would repeat a key, unless they are all it allows."""
        if not self.is_writing_key:
            return
        quotes = self.quote_tokens
        allowed = (words[quotes.ids >> 5] >> (quotes.ids & 31).astype(np.uint32)) & 1
        refused = [
            int(quotes.ids[i])
            for i in np.flatnonzero(allowed)
            if self.would_repeat(quotes.texts[i])
        ]
        if not refused:
            return
        cleared = words.copy()
        for token_id in refused:
            cleared[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
        if cleared.any():  # a row left empty would leave the sampler nothing to draw
            words[:] = cleared

    def feed(self, text: bytes) -> None:
        """One consumed token's bytes."""
        self._fed.append(text)
        self._scan(text)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens fed (the engine dropped them): rare, so the
        state is rebuilt from the rest."""
        del self._fed[len(self._fed) - num_tokens :]
        self._reset()
        for text in self._fed:
            self._scan(text)

    def _scan(self, text: bytes) -> None:
        for byte in text:
            if self._where != _OUTSIDE:
                self._in_string(byte)
            elif byte == _QUOTE:
                is_key = self._expects_key and bool(self._stack) and self._stack[-1] is not None
                self._where = _KEY if is_key else _STRING
                self._key = b""
            elif byte in b"{[":
                self._stack.append(set() if byte == ord("{") else None)
                self._expects_key = byte == ord("{")
            elif byte in b"]}":
                if self._stack:
                    self._stack.pop()
                self._expects_key = False
            elif byte == ord(","):
                self._expects_key = bool(self._stack) and self._stack[-1] is not None
            elif byte == ord(":"):
                self._expects_key = False

    def _in_string(self, byte: int) -> None:
        if self._escaped:
            self._escaped = False
        elif byte == _BACKSLASH:
            self._escaped = True
        elif byte == _QUOTE:
            if self._where == _KEY:
                keys = self._stack[-1]
                assert keys is not None
                keys.add(self._key)
                self._expects_key = False
            self._where = _OUTSIDE
            return
        if self._where == _KEY:
            self._key += bytes((byte,))
