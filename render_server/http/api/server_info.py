"""GET /server_info (vLLM's scale-out API): this server's role and its render fingerprint,
so a router can tell which render servers and workers produce the same token ids."""

from __future__ import annotations

import hashlib

from fastapi import APIRouter

from render_server.http.api.deps import RenderState, StateDep
from render_server.schemas.render_api import RenderFingerprint, RenderFingerprintInfo, ServerInfo

router = APIRouter(tags=["render"])


def _sha256(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def render_fingerprint(state: RenderState) -> RenderFingerprint:
    """The digest of everything that decides a render's token ids: the model, its
    tokenizer (the handshake's digest, so a worker's card can be compared) and the chat
    templates. duet's version stays out: a build that renders the same keeps its digest."""
    renderer = state.renderer
    info = RenderFingerprintInfo(
        model=state.root_model,
        tokenizer_digest=state.tokenizer.digest,
        chat_template_sha256=_sha256(renderer.chat_template),
        tools_template_sha256=_sha256(renderer.tools_template),
    )
    parts = [
        info.model,
        info.tokenizer_digest,
        info.chat_template_sha256 or "",
        info.tools_template_sha256 or "",
    ]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return RenderFingerprint(digest=digest, info=info)


@router.get("/server_info")
async def server_info(state: StateDep) -> ServerInfo:
    """What this server does, for the model it serves, and its render fingerprint."""
    return ServerInfo(
        role="render" if state.workers is None else "render+generate",
        model=state.model_id,
        render_fingerprint=render_fingerprint(state),
    )
