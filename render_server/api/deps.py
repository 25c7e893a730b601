"""Dependencies of the routers, as `Annotated` aliases.

The app holds one RenderState, built once by `app.build_state` from the settings; routes
reach it through `StateDep` rather than through globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from render_server.errors import model_not_found
from render_server.metrics import RenderMetrics
from render_server.settings import RenderSettings

if TYPE_CHECKING:
    from render_server.chat_template import ChatRenderer
    from render_server.tokenizer import Tokenizer


@dataclass(frozen=True)
class RenderState:
    """Everything the routes share, built once per app."""

    settings: RenderSettings
    model_id: str
    """The served name: what clients pass as `model`."""
    root_model: str
    """The model's own name (before --served-model-name)."""
    created: int
    """Unix time the app was built; reported by /v1/models."""
    version: str
    """The duet package version."""
    tokenizer: Tokenizer
    renderer: ChatRenderer
    metrics: RenderMetrics

    def check_model(self, requested: str | None) -> None:
        """Raise the OpenAI 404 unless `requested` is absent or names the served model."""
        if requested and requested != self.model_id:
            raise model_not_found(requested)


# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency on the
# thread pool, which costs far more than these one-line lookups.
async def get_state(request: Request) -> RenderState:
    """The app's RenderState (set by create_app)."""
    return request.app.state.render


async def get_request_id(request: Request) -> str:
    """The id RequestContextMiddleware gave this request (also in X-Request-Id)."""
    return request.scope.get("state", {}).get("request_id", "")


StateDep = Annotated[RenderState, Depends(get_state)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
