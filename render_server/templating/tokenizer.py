"""duet's tokenizer: load one from a GGUF file's metadata or an HF directory.

Token ids must equal what transformers produces for the same files, because the prompt a
worker sees is whatever we encode here. For a GGUF that means building the same
`tokenizers.Tokenizer` that transformers' GGUF loader builds (byte-level BPE, the split
regex named by `tokenizer.ggml.pre`, control tokens as special added tokens); for an HF
directory it means `tokenizer.json` plus the few rules transformers applies on top of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from shared.byte_level import bytes_to_unicode
from shared.gguf_metadata import GGUFError, GGUFMetadata, read_gguf_metadata
from shared.model_source import ModelSource
from shared.tokenizer_digest import digest_gguf_metadata, digest_tokenizer_json

DEFAULT_MAX_MODEL_LEN = 2048

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the regex its merges were learned with, as transformers maps them.
# Any other value (SmolLM2's "smollm" among them) gets GPT-2's ByteLevel regex, which is what
# transformers does too; SmolLM2's merges never join digits, so its digit splitting survives.
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}


# Pre-tokenizers that treat each piece of text between added tokens on its own. Metaspace is
# one only when it prepends always or never: with "first" it looks at where a piece starts.
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
     "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit"}
)  # fmt: skip
_PIECEWISE_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
# Past these sizes tokenizing takes milliseconds (about 0.6 ms per 1,000 characters, 0.3 ms
# per 1,000 ids) where a hop to a thread costs 0.1 ms, so the `*_async` methods run it on a
# thread: requests carry megabytes, and the event loop must not wait for them.
OFF_LOOP_CHARS = 8192
OFF_LOOP_IDS = 4096
_PIECE_CACHE_MAX_TOKENS = 4096  # beyond this many added tokens the split regex gets slow
_PIECE_ENTRY_OVERHEAD = 100


class TokenizerLoadError(ValueError):
    """The model's files describe no tokenizer we can build."""


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
        self._pieces = _PieceCache.for_tokenizer(hf, piece_cache_bytes)

    @classmethod
    def from_source(cls, source: ModelSource, *, piece_cache_bytes: int = 32 << 20) -> Tokenizer:
        """Load the tokenizer of a resolved `--model` (a GGUF file or an HF directory).

        `piece_cache_bytes` bounds the cache of token ids of text pieces seen before; 0 turns
        it off (a cached piece tokenizes faster, which a client could time)."""
        if source.kind == "gguf":
            return _from_gguf(Path(source.path), piece_cache_bytes)
        return _from_hf_dir(Path(source.path), piece_cache_bytes)

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


class _PieceCache:
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
    """

    def __init__(self, hf: HFTokenizer, cut_at: list[str], max_bytes: int) -> None:
        self._hf = hf
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
    def for_tokenizer(cls, hf: HFTokenizer, max_bytes: int) -> _PieceCache | None:
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
        cache = cls(hf, list({token.content for token in cut_first}), max_bytes)
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
                    cached = array("I", _encode(self._hf, piece, False))
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


def _set_post_processor(hf: HFTokenizer, bos: str | None, eos: str | None) -> None:
    """BOS/EOS around each sequence, built the way transformers' update_post_processor does."""
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(token, hf.token_to_id(token)) for token in (bos, eos) if token]
    hf.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


def _add_named_special_tokens(hf: HFTokenizer, tokens: Sequence[str | None]) -> None:
    """Make BOS/EOS/UNK/PAD special added tokens when they are not yet added tokens."""
    added = {token.content for token in hf.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(tokens) if t is not None and t not in added]
    if missing:
        hf.add_tokens([AddedToken(token, special=True, normalized=False) for token in missing])


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge, "left right", as the pair tokenizers' BPE takes."""
    left, _, right = merge.partition(" ")
    return left, right


def _gguf_metadata(path: Path) -> GGUFMetadata:
    try:
        return read_gguf_metadata(path)
    except (GGUFError, OSError) as exc:
        raise TokenizerLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _from_gguf(path: Path, piece_cache_bytes: int) -> Tokenizer:
    meta = _gguf_metadata(path)
    kind = meta.string("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerLoadError(
            f"{path.name}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2', as in SmolLM2, Llama 3 and Qwen2). Serve the model from an HF directory "
            "with a tokenizer.json instead."
        )
    tokens = meta.strings("tokenizer.ggml.tokens")
    token_types = meta.integers("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    # Tokens outside the byte alphabet (some converters store raw text) are respelled byte-wise.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [_merge_pair(merge) for merge in meta.strings("tokenizer.ggml.merges")]
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(meta.string("tokenizer.ggml.pre", ""))
    if split is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    hf.decoder = decoders.ByteLevel()

    # A control token spelled outside the byte alphabet is a converter mislabel; adding it would
    # grow the vocabulary past the embedding, so it is skipped (as transformers does).
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind_ in zip(tokens, token_types, strict=False)
        if kind_ == _GGUF_CONTROL and set(token) <= alphabet
    ]
    hf.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind_ in zip(tokens, token_types, strict=False)
        if kind_ == _GGUF_USER_DEFINED and token in vocab
    ]
    hf.add_tokens(user_defined)

    def named(key: str) -> str | None:
        token_id = meta.integer(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    bos, eos = named("bos_token_id"), named("eos_token_id")
    unk, pad = named("unknown_token_id"), named("padding_token_id")
    _add_named_special_tokens(hf, [bos, eos, unk, pad])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    _set_post_processor(hf, bos if add_bos else None, eos if add_eos else None)

    arch = meta.string("general.architecture", "")
    # End-of-turn and end-of-message ids stop generation too (Llama 3's <|eot_id|>, <|eom_id|>).
    stop_ids = [meta.integer(f"tokenizer.ggml.{key}") for key in ("eot_token_id", "eom_token_id")]
    return Tokenizer(
        hf,
        vocab_size=meta.integer(f"{arch}.vocab_size", len(tokens)),
        bos_token=bos,
        eos_token=eos,
        extra_eos_token_ids=[i for i in stop_ids if i is not None],
        chat_template=meta.string("tokenizer.chat_template"),
        max_model_len=meta.integer(f"{arch}.context_length", DEFAULT_MAX_MODEL_LEN),
        add_bos_token=add_bos,
        unk_token=unk,
        pad_token=pad,
        digest=digest_gguf_metadata(meta.fields),
        piece_cache_bytes=piece_cache_bytes,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: serve the default one.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _from_hf_dir(path: Path, piece_cache_bytes: int) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerLoadError(
            f"{path} has no tokenizer.json (slow tokenizers are not supported)"
        )
    try:
        hf = HFTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
    config = _read_json(path / "tokenizer_config.json")
    model_config = _read_json(path / "config.json")
    text_config = model_config.get("text_config")
    if isinstance(text_config, dict):  # multimodal configs keep the language model's fields here
        model_config = {**text_config, **model_config}
    generation_config = _read_json(path / "generation_config.json")

    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    unk, pad = _token_text(config.get("unk_token")), _token_text(config.get("pad_token"))
    _add_named_special_tokens(hf, [bos, eos, unk, pad])
    # tokenizer.json's post-processor decides BOS/EOS: transformers ignores the config's
    # add_bos_token/add_eos_token when a tokenizer.json is present, and so do we.
    if hf.post_processor is None:
        _set_post_processor(hf, None, None)
    bos_id = hf.token_to_id(bos) if bos is not None else None
    probe = hf.encode("", add_special_tokens=True).ids
    return Tokenizer(
        hf,
        vocab_size=int(model_config.get("vocab_size") or 0),
        bos_token=bos,
        eos_token=eos,
        extra_eos_token_ids=_as_ids(generation_config.get("eos_token_id")),
        chat_template=_hf_chat_template(path, config),
        max_model_len=int(model_config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN),
        add_bos_token=bos_id is not None and probe[:1] == [bos_id],
        unk_token=unk,
        pad_token=pad,
        digest=digest_tokenizer_json(tokenizer_file.read_bytes()),
        piece_cache_bytes=piece_cache_bytes,
    )
