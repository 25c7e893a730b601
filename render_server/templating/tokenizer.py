"""duet's tokenizer: the model's `tokenizers.Tokenizer` with its special tokens, chat
template, context length and digest, and the encode and decode calls the render tier makes.

Its ids must equal what transformers produces for the same files, because the prompt a
worker sees is whatever we encode here; tokenizer_files.py builds it from the model's files
so that they do. Large inputs are encoded in ways that let go of the GIL, and the `*_async`
calls move them off the event loop; repeated text comes from piece_cache.py.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from tokenizers import Tokenizer as HFTokenizer

from render_server.templating.piece_cache import PieceCache
from render_server.templating.tokenizer_files import TokenizerLoadError, read_tokenizer_files
from shared.model_source import ModelSource

__all__ = ["OFF_LOOP_CHARS", "OFF_LOOP_IDS", "Tokenizer", "TokenizerLoadError"]

# Past these sizes tokenizing takes milliseconds (about 0.6 ms per 1,000 characters, 0.3 ms
# per 1,000 ids) where a hop to a thread costs 0.1 ms, so the `*_async` methods run it on a
# thread: requests carry megabytes, and the event loop must not wait for them.
OFF_LOOP_CHARS = 8192
OFF_LOOP_IDS = 4096


class Tokenizer:
    """duet's tokenizer: a tokenizers.Tokenizer plus the model's special tokens, chat
    template and context length, with a digest that workers check their card against."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        vocab_size: int,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None,
        max_model_len: int,
        add_bos_token: bool,
        unk_token: str | None = None,
        pad_token: str | None = None,
        digest: str | None = None,
        piece_cache_bytes: int = 32 << 20,
    ) -> None:
        self.hf = hf
        self.vocab_size = max(vocab_size, hf.get_vocab_size(with_added_tokens=True))
        self.bos_token = bos_token
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token = eos_token
        eos_ids = [hf.token_to_id(eos_token)] if eos_token is not None else []
        self.eos_token_ids = list(
            dict.fromkeys(i for i in [*eos_ids, *extra_eos_token_ids] if i is not None)
        )
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.add_bos_token = add_bos_token
        added = sorted(hf.get_added_tokens_decoder().items())
        self.special_tokens = [token.content for _, token in added if token.special]
        canonical = hf.to_str()
        # Workers compute the digest from the model files (shared/tokenizer_digest.py); a
        # tokenizer built in memory falls back to its own serialization.
        self.digest = digest or hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        # A second instance that reads special-token text as plain text. `encode_special_tokens`
        # is state on the tokenizer object, so flipping it on `hf` would race with other threads.
        self._plain = HFTokenizer.from_str(canonical)
        self._plain.encode_special_tokens = True
        self._pieces = PieceCache.for_tokenizer(
            hf, piece_cache_bytes, lambda piece: _encode(hf, piece, False)
        )

    @classmethod
    def from_source(cls, source: ModelSource, *, piece_cache_bytes: int = 32 << 20) -> Tokenizer:
        """Load the tokenizer of a resolved `--model` (a GGUF file or an HF directory).

        `piece_cache_bytes` bounds the cache of token ids of text pieces seen before; 0 turns
        it off (a cached piece tokenizes faster, which a client could time). Raises
        TokenizerLoadError when the files describe no tokenizer we can build."""
        files = read_tokenizer_files(source)
        return cls(
            files.hf,
            vocab_size=files.vocab_size,
            bos_token=files.bos_token,
            eos_token=files.eos_token,
            extra_eos_token_ids=files.extra_eos_token_ids,
            chat_template=files.chat_template,
            max_model_len=files.max_model_len,
            add_bos_token=files.add_bos_token,
            unk_token=files.unk_token,
            pad_token=files.pad_token,
            digest=files.digest,
            piece_cache_bytes=piece_cache_bytes,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode(self.hf, text, add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """`encode(text, add_special_tokens=False)`, reusing the ids of pieces of text (the
        runs between added tokens) seen before: a chat's earlier turns and system prompt
        come back with every request."""
        if self._pieces is None:
            return _encode(self.hf, text, False)
        return self._pieces.encode(text)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def encode_plain(self, text: str) -> list[int]:
        """Encode with special-token text read as ordinary characters, and no BOS."""
        return _encode(self._plain, text, False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if len(ids) <= OFF_LOOP_IDS:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        # Like `encode_batch`, `decode_batch` lets go of the GIL while it works; `decode` not.
        return self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        # Ids past the vocabulary (padding rows of the embedding) have no text.
        return [self.hf.id_to_token(token_id) or "" for token_id in token_ids]

    # For the event loop: the same calls, on a thread when the input is large.

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        large = len(text) > OFF_LOOP_CHARS
        return await _on_thread_if(large, self.encode, text, add_special_tokens)

    async def encode_batch_async(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        large = sum(map(len, texts)) > OFF_LOOP_CHARS
        return await _on_thread_if(large, self.encode_batch, texts, add_special_tokens)

    async def decode_async(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        large = len(token_ids) > OFF_LOOP_IDS
        return await _on_thread_if(large, self.decode, token_ids, skip_special_tokens)

    async def token_strs_async(self, token_ids: Sequence[int]) -> list[str]:
        large = len(token_ids) > OFF_LOOP_IDS
        return await _on_thread_if(large, self.token_strs, token_ids)


_P = ParamSpec("_P")
_T = TypeVar("_T")


async def _on_thread_if(
    large: bool, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
) -> _T:
    if large:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _encode(hf: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`hf.encode(text).ids`. A long text goes through `encode_batch_fast` instead, for the
    same ids: `encode` holds the GIL throughout, so on a thread a megabyte prompt would
    still stop every other thread (the event loop's too) for seconds, and the offsets it
    keeps take the GIL for half a second more to free (5 MB of text)."""
    if len(text) <= OFF_LOOP_CHARS:
        return hf.encode(text, add_special_tokens=add_special_tokens).ids
    return hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
