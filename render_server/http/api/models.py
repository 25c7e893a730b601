"""GET /v1/models and GET /v1/models/{model}, in the OpenAI list shape."""

from __future__ import annotations

from fastapi import APIRouter

from render_server.http.api.deps import RenderState, StateDep
from render_server.schemas.errors import ErrorResponse, model_not_found
from render_server.schemas.models import ModelInfo, ModelList

router = APIRouter(prefix="/v1/models", tags=["models"])


def _model_info(state: RenderState) -> ModelInfo:
    return ModelInfo(
        id=state.model_id,
        created=state.created,
        root=state.root_model,
        max_model_len=state.tokenizer.max_model_len,
    )


@router.get("")
async def list_models(state: StateDep) -> ModelList:
    """The one model this server renders for."""
    return ModelList(data=[_model_info(state)])


@router.get("/{model:path}", responses={404: {"model": ErrorResponse}})
async def retrieve_model(model: str, state: StateDep) -> ModelInfo:
    """One model by id (ids may contain `/`, hence the path converter)."""
    if model != state.model_id:
        raise model_not_found(model)
    return _model_info(state)
