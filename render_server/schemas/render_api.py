"""Bodies of vLLM's scale-out render API beside `GenerateRequest` (schemas/generate_api.py):
GET /server_info and its render fingerprint."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

SCHEMA_VERSION = 1
"""The version of the scale-out bodies this server speaks (render, generate, derender)."""


class RenderFingerprintInfo(BaseModel):
    """What the fingerprint's digest covers, each part on its own, so two servers whose
    digests differ can tell why."""

    model: str
    """The model's own name (before --served-model-name)."""
    tokenizer_digest: str
    """The digest the worker handshake checks (ModelCard.tokenizer_digest)."""
    chat_template_sha256: str | None
    tools_template_sha256: str | None
    """The built-in template a chat with tools renders with, when the model's own
    template cannot show tools."""


class RenderFingerprint(BaseModel):
    """Equal digests: the same request renders to the same token ids."""

    digest: str
    info: RenderFingerprintInfo


class ServerInfo(BaseModel):
    """The GET /server_info response."""

    role: Literal["render", "render+generate"]
    """"render" on a --render-only server (it cannot generate)."""
    model: str
    """The served name: what clients pass as `model`."""
    schema_version: int = SCHEMA_VERSION
    render_fingerprint: RenderFingerprint
