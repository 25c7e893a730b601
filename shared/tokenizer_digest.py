"""The tokenizer digest both tiers compute from the model files, without tokenizing.

A worker never loads a tokenizer, yet the render tier must refuse a worker whose
vocabulary differs from its own. So the digest is taken over what defines the
vocabulary in the files themselves: for GGUF, every `tokenizer.*` metadata field; for an
HF directory, `tokenizer.json`. It does not depend on the `tokenizers` library version.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from shared.gguf_metadata import read_gguf_metadata
from shared.model_source import ModelSource


def digest_gguf_metadata(metadata: Mapping[str, Any]) -> str:
    """Digest of a GGUF file's `tokenizer.*` fields (all metadata may be passed)."""
    fields = {
        name: value
        for name, value in metadata.items()
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template"
    }
    canonical = json.dumps(fields, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def digest_tokenizer_json(content: bytes) -> str:
    """Digest of an HF directory's `tokenizer.json` bytes."""
    return hashlib.sha256(content).hexdigest()


def tokenizer_digest(source: ModelSource) -> str:
    """Hex SHA-256 identifying the model's vocabulary and special tokens."""
    if source.kind == "gguf":
        return digest_gguf_metadata(read_gguf_metadata(source.path).fields)
    tokenizer_json = source.path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{source.path} has no tokenizer.json")
    return digest_tokenizer_json(tokenizer_json.read_bytes())
