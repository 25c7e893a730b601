"""Token ids of text pieces seen before, for `Tokenizer.encode_text` (tokenizer.py).

A chat's earlier turns and system prompt come back with every request; encoding the runs
of text between added tokens once and remembering them is exact for the pipelines
`PieceCache.for_tokenizer` accepts, and it checks that on probe texts before it is used.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizers that treat each piece of text between added tokens on its own. Metaspace is
# one only when it prepends always or never: with "first" it looks at where a piece starts.
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
     "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit"}
)  # fmt: skip
_PIECEWISE_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
_PIECE_CACHE_MAX_TOKENS = 4096  # beyond this many added tokens the split regex gets slow
_PIECE_ENTRY_OVERHEAD = 100


class PieceCache:
    """Token ids of the pieces of text between added tokens, remembered up to a budget.

    Exact by construction: `tokenizers` first cuts the text at its added tokens (leftmost-
    longest match, the non-normalized ones on the raw text), then normalizes, pre-tokenizes
    and runs the model on each piece alone. So the ids of a text are the ids of its pieces
    and of its added tokens, in order; `for_tokenizer` builds a cache only for pipelines where
    nothing looks across a piece (no truncation, padding, BPE dropout, "first"-only prefix,
    or added tokens that strip spaces around them), and checks itself on probe texts.

    Memory is bounded by `max_bytes`, counted as the entries' sizes plus a per-entry
    overhead, so a flood of tiny pieces fills it as surely as a few long ones; the oldest
    entries go first. A hit is faster than a miss, so a client could time whether some exact
    text was sent recently; that is the trade prefix caching on the workers makes too (and
    much louder).

    `encode_piece` encodes one piece the cache has not seen, without special tokens.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        cut_at: list[str],
        max_bytes: int,
        encode_piece: Callable[[str], list[int]],
    ) -> None:
        self._hf = hf
        self._encode_piece = encode_piece
        # Longest first: Python's leftmost-first alternation then picks what the
        # leftmost-longest Aho-Corasick matcher of `tokenizers` picks.
        alternatives = "|".join(map(re.escape, sorted(cut_at, key=len, reverse=True)))
        self._splitter = re.compile(f"({alternatives or '(?!)'})")
        # Every piece cut at is an added token, so every one has an id.
        self._added_ids = {
            content: token_id
            for content in cut_at
            if (token_id := hf.token_to_id(content)) is not None
        }
        self._max_bytes = max_bytes
        # Oldest first; OrderedDict evicts from the front in O(1), where a dict would scan
        # past the slots of every entry deleted there since it last resized.
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(
        cls, hf: HFTokenizer, max_bytes: int, encode_piece: Callable[[str], list[int]]
    ) -> PieceCache | None:
        """A cache for `hf`, or None when its pipeline is not piecewise (or max_bytes is 0)."""
        added = list(hf.get_added_tokens_decoder().values())
        cut_first = [token for token in added if not token.normalized]
        if (
            max_bytes <= 0
            or hf.truncation is not None
            or hf.padding is not None
            or hf.encode_special_tokens
            or not _is_piecewise_model(hf)
            or (hf.pre_tokenizer is not None and not _is_piecewise_pre_tokenizer(hf))
            or len(added) > _PIECE_CACHE_MAX_TOKENS
            or any(token.lstrip or token.rstrip or token.single_word for token in cut_first)
        ):
            return None
        cache = cls(hf, list({token.content for token in cut_first}), max_bytes, encode_piece)
        return cache if cache._agrees_on_probes([token.content for token in added]) else None

    def _agrees_on_probes(self, added: list[str]) -> bool:
        samples = ["Hello world", " x  y\n\n", "é漢字 123 ", "  "]
        tokens = added[:16]
        text = "".join(f"{samples[i % 4]}{token}{token}" for i, token in enumerate(tokens))
        probes = [*samples, *tokens, text, text[1:], f"  {text} "]
        want = [self._hf.encode(probe, add_special_tokens=False).ids for probe in probes]
        got = [self.encode(probe) for probe in probes]
        got_again = [self.encode(probe) for probe in probes]  # from the cache this time
        self.clear()
        return want == got == got_again

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        entries = self._entries
        for index, piece in enumerate(self._splitter.split(text)):
            if index % 2:  # the splitter's group: an added token
                ids.append(self._added_ids[piece])
            elif piece:
                cached = entries.get(piece)
                if cached is None:
                    cached = array("I", self._encode_piece(piece))
                    self._store(piece, cached)
                ids += cached
        return ids

    def _store(self, piece: str, ids: array[int]) -> None:
        size = _entry_bytes(piece, ids)
        if size > self._max_bytes // 64:  # one huge piece would flush everything else
            return
        with self._lock:
            entries = self._entries
            if piece in entries:
                return
            while entries and self._bytes + size > self._max_bytes:
                self._bytes -= _entry_bytes(*entries.popitem(last=False))
            entries[piece] = ids
            self._bytes += size


def _entry_bytes(piece: str, ids: array[int]) -> int:
    # The key and the ids as Python holds them, plus about what a dict slot costs.
    return sys.getsizeof(piece) + sys.getsizeof(ids) + _PIECE_ENTRY_OVERHEAD


def _is_piecewise_model(hf: HFTokenizer) -> bool:
    kind = type(hf.model).__name__
    return kind in _PIECEWISE_MODELS and not (kind == "BPE" and hf.model.dropout)


def _is_piecewise_pre_tokenizer(hf: HFTokenizer) -> bool:
    def piecewise(spec: dict[str, Any]) -> bool:
        kind = spec.get("type")
        if kind == "Sequence":
            return all(piecewise(inner) for inner in spec.get("pretokenizers", []))
        if kind == "Metaspace":
            return spec.get("prepend_scheme") in ("always", "never")
        return kind in _PIECEWISE_PRE_TOKENIZERS

    try:
        return piecewise(json.loads(hf.pre_tokenizer.__getstate__()))
    except (TypeError, ValueError, AttributeError):
        return False
