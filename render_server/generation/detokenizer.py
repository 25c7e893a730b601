"""Incremental detokenization: token ids in, client-safe text out, stop strings cut exactly.

Two layers. The decoder turns ids into text without ever showing half a character: it keeps
vLLM's prefix/read window (decode the last emitted chunk plus the ids since, emit the
difference once it no longer ends in U+FFFD), so each step costs O(window), not O(output).
The stop layer then holds back only the tail that could still grow into a stop string (at
most the longest stop less one character), so text a stop later removes is never streamed.
A decoder step that ends inside a character holds that step's whole text (as in vLLM), so
multi-id chunks cut mid-character release one step late. Output that ends inside a
character (a length cut) ends before it: the text never ends in U+FFFD, while the logprobs'
`bytes` still carry those bytes.

With stop strings, a multi-id chunk (a speculative step's accepted tokens, deltas merged
while the consumer was busy, a derender's whole output) gives what its ids give one at a
time: stepped whole when its text comes out and holds no stop, else rewound and stepped id by
id, so a stop is found at the id where one id per delta finds it, and
`DetokenizerUpdate.num_ids_kept` says how many of the chunk's ids the output keeps (the token
ids, logprobs and usage end where the text does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel

from render_server.templating.tokenizer import Tokenizer
from shared.byte_level import unicode_to_bytes

# DecodeStream (tokenizers >= 0.22: `ids=` prefill and list steps) runs the same window scheme
# in Rust: one Python call per step instead of two `decode` calls plus list slicing
# (bench/detokenizer.py measures the detokenizer). Older tokenizers get the same scheme in
# Python.
try:
    from tokenizers.decoders import DecodeStream

    _HAS_DECODE_STREAM = "ids" in (DecodeStream.__text_signature__ or "")
except ImportError:  # tokenizers < 0.21
    _HAS_DECODE_STREAM = False

# Prompt ids kept as decoder context, as vLLM's initial prefix offset: enough for decoders
# whose output depends on the previous token (a leading space), never emitted.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
_BYTE_OF_CHAR = unicode_to_bytes()
# A UTF-8 lead byte's high nibble -> the length of its character (1: ASCII or invalid).
_UTF8_LENGTH = {0xC: 2, 0xD: 2, 0xE: 3, 0xF: 4}


@dataclass(slots=True)
class DetokenizerUpdate:
    """What one `add` produced: text to send now, and whether a stop string ended the request."""

    text: str
    stop_str: str | None = None
    finished_by_stop: bool = False
    num_ids_kept: int | None = None
    """When a stop string ended it: how many of the ids this `add` was given count (the one
    whose text completed the stop and those before it; the output drops the rest). None:
    all of them."""


# A _Decoder's context, pending ids and context text (its stream is rebuilt from them).
_DecoderMark = tuple[list[int], list[int], str]


class _Decoder:
    """Ids -> text, emitting only complete characters.

    Invariant: `context` is the ids of the last emitted chunk (or the prompt tail) and
    `pending` the ids fed since; `context + pending` is exactly DecodeStream's window.
    """

    def __init__(self, hf: HFTokenizer, skip_special_tokens: bool, context: list[int]) -> None:
        self.hf = hf
        self.skip = skip_special_tokens
        # A prompt tail that ends inside a character would make the first completed character
        # look like a rewrite of the context; drop those ids (their bytes were the prompt's).
        while context and self._decode(context).endswith(_REPLACEMENT):
            context = context[:-1]
        self.context = context
        self.pending: list[int] = []
        self.context_text = self._decode(context)  # only kept up to date on the Python path
        self.stream = self._new_stream()

    def _decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=self.skip)

    def _new_stream(self) -> DecodeStream | None:
        if not _HAS_DECODE_STREAM:
            return None
        stream = DecodeStream(ids=self.context, skip_special_tokens=self.skip)
        if self.pending:
            stream.step(self.hf, self.pending)  # replays held ids; returns None as it did before
        return stream

    def mark(self) -> _DecoderMark:
        """The state `rewind` goes back to."""
        return self.context, list(self.pending), self.context_text

    def rewind(self, mark: _DecoderMark) -> None:
        """Back to `mark`, as if the steps since had not run."""
        self.context, self.pending, self.context_text = mark[0], list(mark[1]), mark[2]
        self.stream = self._new_stream()

    def step(self, ids: list[int]) -> str:
        try:
            return self._step(ids)
        except Exception:
            # Some id (negative, past 2**32, or one the decoder rejects) broke the batch: retry
            # one at a time, skipping the ids that fail, from a stream rebuilt off the mirror
            # (a failed Rust step may already hold the id).
            self.stream = self._new_stream()
            pieces: list[str] = []
            for token_id in ids:
                try:
                    pieces.append(self._step([token_id]))
                except Exception:
                    self.stream = self._new_stream()
            return "".join(pieces)

    def _step(self, ids: list[int]) -> str:
        if self.stream is not None:
            piece = self.stream.step(self.hf, ids)
            self.pending += ids
        else:
            window = self.pending + ids
            full = self._decode(self.context + window)  # raises before any state changes
            self.pending = window
            piece = None
            if len(full) > len(self.context_text) and not full.endswith(_REPLACEMENT):
                piece = full[len(self.context_text) :]
                self.context_text = self._decode(self.pending)
        if piece is None:
            return ""
        self.context, self.pending = self.pending, []
        return piece

    def flush(self) -> str:
        """The held ids' text, less a last character their bytes leave incomplete (a
        length cut mid-character): as while streaming, it is never shown as U+FFFD."""
        if not self.pending:
            return ""
        text = self._decode(self.context + self.pending)[len(self._decode(self.context)) :]
        # An incomplete tail decodes to exactly one U+FFFD; the bytes tell it from a
        # replacement character the model wrote or bytes no later id could complete.
        if text.endswith(_REPLACEMENT) and self._ends_inside_character(self.pending):
            text = text[:-1]
        self.context, self.pending = self.pending, []
        self.stream = self._new_stream()
        return text

    def _ends_inside_character(self, ids: list[int]) -> bool:
        """Whether the bytes of `ids` end with the head of a UTF-8 character."""
        byte_level = isinstance(self.hf.decoder, ByteLevel)
        tail = b""
        for token_id in reversed(ids):
            tail = _piece_bytes(self.hf.id_to_token(token_id) or "", byte_level) + tail
            if len(tail) >= 4:
                break
        return _is_incomplete_utf8(tail[-4:])


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    """A vocabulary piece's bytes: GPT-2's byte alphabet, SentencePiece's `<0xNN>` byte
    fallback, or else the piece's own text."""
    if byte_level and all(char in _BYTE_OF_CHAR for char in piece):
        return bytes(_BYTE_OF_CHAR[char] for char in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.encode()


def _is_incomplete_utf8(tail: bytes) -> bool:
    """Whether `tail` (the last bytes, at most 4) ends with a lead byte and fewer
    continuation bytes than it announces."""
    for back in range(1, len(tail) + 1):
        byte = tail[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last lead (or ASCII)
            return back < _UTF8_LENGTH.get(byte >> 4, 1)
    return False


class IncrementalDetokenizer:
    """One request's streaming detokenizer: feed generated ids with `add`, then `flush`.

    Stop strings are matched across token boundaries. The first stop to complete in the text
    wins (ties: the one starting earliest), so the result never depends on how ids were
    chunked. Text after the stop, and every later id, is dropped. Afterwards `stop_str` and
    `is_finished` say how the request ended; `add` after `flush` or a stop returns no text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._decoder = _Decoder(tokenizer.hf, skip_special_tokens, context)
        self._stops = list(dict.fromkeys(s for s in stop or [] if s))
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max(map(len, self._stops), default=0)
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._held = ""  # decoded, not yet emitted: a tail that may start a stop string
        self._emitted: list[str] = []
        self.stop_str: str | None = None  # the stop string that finished the request, if any
        self.is_finished = False

    @property
    def output_text(self) -> str:
        """Everything emitted so far (by `add` and `flush`)."""
        return "".join(self._emitted)

    def add(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feed newly generated ids; returns the text that is safe to send now."""
        if self.is_finished or not token_ids:
            return DetokenizerUpdate("")
        if self._stops and len(token_ids) > 1:
            return self._add_chunk(token_ids)
        new_text = self._decoder.step(list(token_ids))
        if not new_text:
            return DetokenizerUpdate("")
        if not self._stops:
            self._emitted.append(new_text)
            return DetokenizerUpdate(new_text)
        return self._check_stops(new_text, release_all=False)

    def _add_chunk(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Several ids with stop strings: what they give one at a time. Stepped whole when
        that is the same (the chunk's text is released and holds no stop), else stepped
        again id by id from where the chunk began."""
        mark = self._decoder.mark()
        new_text = self._decoder.step(list(token_ids))
        if new_text and self._find_stop(self._held + new_text) is None:
            return self._check_stops(new_text, release_all=False)
        self._decoder.rewind(mark)
        return self._add_each(token_ids)

    def _add_each(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """`add` one id at a time: a stop string then ends the output at the id that
        completed it, as when each id came alone, not at the end of the chunk (whose last
        ids could also hold back the text of the first while a character is incomplete)."""
        released: list[str] = []
        for number, token_id in enumerate(token_ids, start=1):
            new_text = self._decoder.step([token_id])
            if not new_text:
                continue
            update = self._check_stops(new_text, release_all=False)
            released.append(update.text)
            if update.finished_by_stop:
                return DetokenizerUpdate("".join(released), update.stop_str, True, number)
        return DetokenizerUpdate("".join(released))

    def flush(self) -> str:
        """End of generation: release held text and the ids still waiting for a character,
        less a last character they leave incomplete."""
        if self.is_finished:
            return ""
        self.is_finished = True
        tail = self._decoder.flush()
        if not self._stops:
            self._emitted.append(tail)
            return tail
        return self._check_stops(tail, release_all=True).text

    def _check_stops(self, new_text: str, *, release_all: bool) -> DetokenizerUpdate:
        # Only `held + new_text` is searched: every stop occurrence ending earlier was already
        # found, and the held tail is the longest one a stop could still start in.
        text = self._held + new_text
        match = self._find_stop(text)
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self._include_stop else start
            self._held = ""
            self.stop_str = stop_str
            self.is_finished = True
            self._emitted.append(text[:end])
            return DetokenizerUpdate(text[:end], stop_str, True)
        cut = len(text) if release_all else self._hold_from(text)
        self._held = text[cut:]
        self._emitted.append(text[:cut])
        return DetokenizerUpdate(text[:cut])

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop that completes first in `text` (ties: the earliest start), if any."""
        # `held` contains no stop, so any occurrence ends in the new text and searching from 0
        # is exact; the `in` pre-check keeps the common no-match step to one C call per stop.
        hits = [(text.find(s) + len(s), text.find(s), s) for s in self._stops if s in text]
        if not hits:
            return None
        _, start, stop = min(hits)
        return start, stop

    def _hold_from(self, text: str) -> int:
        """Start of the longest tail of `text` that is a proper prefix of some stop string."""
        lo = max(0, len(text) - self._max_stop_len + 1)
        if self._first_chars.isdisjoint(text[lo:]):
            return len(text)  # the usual case: no stop can even begin in the window
        cut = len(text)
        for stop in self._stops:
            # No match of `stop` is in `text`, so its prefix can start at most len-1 back.
            first = stop[0]
            i = text.find(first, max(lo, len(text) - len(stop) + 1), cut)
            while i != -1:
                if stop.startswith(text[i:]):
                    cut = i
                    break
                i = text.find(first, i + 1, cut)
        return cut
