"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA routes.

They exist only with --allow-runtime-lora-updating (vLLM registers them only under
VLLM_ALLOW_RUNTIME_LORA_UPDATING), so without it they are a 404. A load or unload runs on
every connected worker, which reads the adapter from its own disk. Success is vLLM's
plain-text line; an error has the shape of every other route's (OpenAI's: a `type`, the
field as `param`, a string `code`), not vLLM's (its exception class as `type`, the status
as `code`), so one client error handler reads them all.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from render_server.http.api.deps import StateDep
from render_server.http.serving import REQUEST_ERRORS
from render_server.schemas.errors import INVALID_REQUEST, SERVER_ERROR, ApiError, quoted
from render_server.schemas.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from render_server.worker_client.lora import LoRAOutcome

logger = logging.getLogger(__name__)

router = APIRouter(tags=["lora"])

_CODES = {
    400: "invalid_lora_adapter",
    404: "lora_not_found",
    409: "lora_conflict",
    503: "worker_unavailable",
    504: "timeout",
}


def _lora_error(status: int, message: str, param: str | None = "lora_name") -> ApiError:
    """An error of these routes, in every route's shape."""
    kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
    return ApiError(status, message, type=kind, param=param, code=_CODES.get(status, "lora_failed"))


def _worker_failure(outcomes: list[LoRAOutcome], *, ignore_status: int | None = None) -> ApiError:
    """The error of the first worker that failed (other than with `ignore_status`)."""
    failed = next(
        outcome for outcome in outcomes if not outcome.ok and outcome.status != ignore_status
    )
    status = failed.status if 400 <= failed.status < 600 else 500
    param = "lora_path" if status in (400, 404) else None
    return _lora_error(status, f"worker {failed.address}: {failed.message}", param)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=REQUEST_ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: StateDep) -> PlainTextResponse:
    """Load an adapter on every connected worker; `model: lora_name` then selects it."""
    if not body.lora_name or not body.lora_path:
        missing = "lora_name" if not body.lora_name else "lora_path"
        raise _lora_error(400, "Both 'lora_name' and 'lora_path' must be provided.", missing)
    name = body.lora_name
    if name == state.model_id or name in state.lora_adapters():
        raise _lora_error(400, f"The lora adapter '{quoted(name)}' has already been loaded.")
    pool = state.require_workers()
    outcomes = await pool.load_lora(name, body.lora_path, state.settings.lora_op_timeout_s)
    if not outcomes:  # every worker left before it was sent
        raise ApiError(
            503,
            "No gpu-worker is connected and alive; retry shortly.",
            type=SERVER_ERROR,
            code="no_workers",
            headers={"Retry-After": "1"},
        )
    if not all(outcome.ok for outcome in outcomes):
        raise _worker_failure(outcomes)
    logger.info("loaded LoRA adapter %r from %r on %d workers", name, body.lora_path, len(outcomes))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=REQUEST_ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: StateDep) -> PlainTextResponse:
    """Unload an adapter from every connected worker (a 409 while requests use it)."""
    if not body.lora_name:
        raise _lora_error(400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
    name = body.lora_name
    if name not in state.lora_adapters():
        raise _lora_error(404, f"The lora adapter '{quoted(name)}' cannot be found.")
    pool = state.require_workers()
    outcomes = await pool.unload_lora(name, state.settings.lora_op_timeout_s)
    # A worker that never had it (404) is no failure, as long as one had it.
    if any(not outcome.ok and outcome.status != 404 for outcome in outcomes):
        raise _worker_failure(outcomes, ignore_status=404)
    if not any(outcome.ok for outcome in outcomes):
        raise _lora_error(404, f"The lora adapter '{quoted(name)}' cannot be found.")
    logger.info("unloaded LoRA adapter %r from %d workers", name, len(outcomes))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
