"""GET /v1/models and GET /v1/models/{model}, in the OpenAI list shape: the served model,
then every LoRA adapter a request may select (with `parent` the served model, as vLLM
lists them)."""

from __future__ import annotations

from fastapi import APIRouter

from render_server.http.api.deps import RenderState, StateDep
from render_server.schemas.errors import ErrorResponse, model_not_found
from render_server.schemas.models import ModelInfo, ModelList

router = APIRouter(prefix="/v1/models", tags=["models"])


def _model_infos(state: RenderState) -> list[ModelInfo]:
    max_model_len = state.tokenizer.max_model_len
    base = ModelInfo(
        id=state.model_id, created=state.created, root=state.root_model, max_model_len=max_model_len
    )
    adapters = [
        ModelInfo(
            id=name,
            created=state.created,
            root=path,
            parent=state.model_id,
            max_model_len=max_model_len,
        )
        for name, path in sorted(state.lora_adapters().items())
    ]
    return [base, *adapters]


@router.get("")
async def list_models(state: StateDep) -> ModelList:
    """The model this server renders for and its LoRA adapters."""
    return ModelList(data=_model_infos(state))


@router.get("/{model:path}", responses={404: {"model": ErrorResponse}})
async def retrieve_model(model: str, state: StateDep) -> ModelInfo:
    """One model by id (ids may contain `/`, hence the path converter)."""
    info = next((info for info in _model_infos(state) if info.id == model), None)
    if info is None:
        raise model_not_found(model)
    return info
