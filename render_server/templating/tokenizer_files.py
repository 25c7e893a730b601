"""A tokenizer from a model's files: a GGUF file's metadata or an HF directory.

Token ids must equal what transformers produces for the same files, because the prompt a
worker sees is whatever we encode. For a GGUF that means building the same
`tokenizers.Tokenizer` that transformers' GGUF loader builds (byte-level BPE, the split
regex named by `tokenizer.ggml.pre`, control tokens as special added tokens); for an HF
directory it means `tokenizer.json` plus the few rules transformers applies on top of it.
`Tokenizer.from_source` (tokenizer.py) wraps what is read here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class TokenizerLoadError(ValueError):
    """The model's files describe no tokenizer we can build."""


@dataclass(frozen=True)
class TokenizerFiles:
    """What a model's files say about its tokenizer, as `Tokenizer` takes it."""

    hf: HFTokenizer
    """Built to encode exactly as transformers does for the same files."""
    vocab_size: int
    """The model's (its embedding rows); 0 when the files do not say."""
    bos_token: str | None
    eos_token: str | None
    extra_eos_token_ids: list[int]
    """Ids that end generation besides the EOS token's (end of turn, end of message)."""
    chat_template: str | None
    max_model_len: int
    add_bos_token: bool
    """Whether encoding with special tokens puts the BOS token first."""
    unk_token: str | None
    pad_token: str | None
    digest: str
    """Of the files, computed as the workers compute it (shared/tokenizer_digest.py)."""


def read_tokenizer_files(source: ModelSource) -> TokenizerFiles:
    """The tokenizer of a resolved `--model`; a TokenizerLoadError when there is none we
    can build."""
    if source.kind == "gguf":
        return _read_gguf(Path(source.path))
    return _read_hf_dir(Path(source.path))


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


def _read_gguf(path: Path) -> TokenizerFiles:
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
    return TokenizerFiles(
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


def _read_hf_dir(path: Path) -> TokenizerFiles:
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
    return TokenizerFiles(
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
    )
