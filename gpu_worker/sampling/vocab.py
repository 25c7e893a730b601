"""llguidance's view of the model's vocabulary on the worker, read from the model files.

The worker never loads the render tier's tokenizer; llguidance only needs every token's
bytes: from tokenizer.json, or from the GGUF vocabulary decoded byte-level, without the
`tokenizers` package.
"""

from __future__ import annotations

from pathlib import Path

import llguidance

from shared.byte_level import unicode_to_bytes
from shared.constraints import ConstraintError
from shared.gguf_metadata import GGUFError, read_gguf_metadata
from shared.model_source import ModelSource

_GGUF_CONTROL = 3
_MAX_GREEDY_TOKEN_BYTES = 256


def lltokenizer_from_source(
    source: ModelSource, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary, read from the model files."""
    if source.kind == "hf":
        tokenizer_json = Path(source.path) / "tokenizer.json"
        text = tokenizer_json.read_text(encoding="utf-8")
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_ids)
    return _lltokenizer_from_gguf(source.path, vocab_size, eos_token_ids)


def _lltokenizer_from_gguf(
    path: Path, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    try:
        # Only the four keys it needs: the merges, a second ~100k strings, are stepped over.
        meta = read_gguf_metadata(path, _GGUF_VOCAB_KEYS)
    except GGUFError as exc:
        raise ConstraintError(str(exc)) from exc
    kind = meta.string("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConstraintError(f"structured outputs need a byte-level BPE vocabulary, not {kind!r}")
    tokens = meta.strings("tokenizer.ggml.tokens")
    token_types = meta.integers("tokenizer.ggml.token_type") or [1] * len(tokens)
    byte_of = unicode_to_bytes()
    token_bytes: list[bytes] = []
    special: list[int] = []
    for token_id, (token, kind_) in enumerate(zip(tokens, token_types, strict=False)):
        if kind_ == _GGUF_CONTROL:
            special.append(token_id)
            token_bytes.append(token.encode())
        elif all(char in byte_of for char in token):
            token_bytes.append(bytes(byte_of[char] for char in token))
        else:  # some converters store raw text
            token_bytes.append(token.encode())
    vocab = _GreedyVocab(
        token_bytes,
        special,
        eos_token_ids[0] if eos_token_ids else 0,
        meta.integer("tokenizer.ggml.bos_token_id"),
    )
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size, eos_token=eos_token_ids
    )


_GGUF_VOCAB_KEYS = frozenset(
    {
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
    }
)


class _GreedyVocab:
    """The token table llguidance's TokenizerWrapper asks for. Its tokenizer is greedy
    longest-match: llguidance tokenizes only for prompt healing and forced tokens, which
    the engine does not use, so it is never on the sampling path."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, bos: int | None) -> None:
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = bos
        skip = set(special)
        self._ids = {t: i for i, t in enumerate(tokens) if t and i not in skip}

    def __call__(self, text: bytes) -> list[int]:
        ids: list[int] = []
        start = 0
        while start < len(text):
            for end in range(min(len(text), start + _MAX_GREEDY_TOKEN_BYTES), start, -1):
                token_id = self._ids.get(text[start:end])
                if token_id is not None:
                    ids.append(token_id)
                    start = end
                    break
            else:
                start += 1  # a byte no token spells (impossible for byte-level BPE)
        return ids
