"""The tokenizer digest both tiers compute from the model files, without tokenizing.

A worker never loads a tokenizer, yet the render tier must refuse a worker whose
vocabulary differs from its own. So the digest is taken over what defines the
vocabulary in the files themselves: for GGUF, every `tokenizer.*` metadata field; for an
HF directory, `tokenizer.json`. It does not depend on the `tokenizers` library version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shared.model_source import ModelSource


def _gguf_tokenizer_fields(path: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(path)
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template"
    }


def tokenizer_digest(source: ModelSource) -> str:
    """Hex SHA-256 identifying the model's vocabulary and special tokens."""
    if source.kind == "gguf":
        fields = _gguf_tokenizer_fields(source.path)
        canonical = json.dumps(fields, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    tokenizer_json = source.path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{source.path} has no tokenizer.json")
    return hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
