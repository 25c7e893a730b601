"""Operational endpoints: /health, /ready and /version (public), /metrics (needs the key)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from render_server.http.api.deps import StateDep
from render_server.http.metrics import METRICS_CONTENT_TYPE
from render_server.schemas.models import HealthResponse, VersionResponse

router = APIRouter(tags=["admin"])

_HEALTHY = HealthResponse()


@router.get("/health")
async def health() -> HealthResponse:
    """200 while the process serves HTTP; cheap enough for tight liveness probes."""
    return _HEALTHY


@router.get("/ready")
async def ready(state: StateDep) -> Response:
    """200 when at least one worker is connected and alive (always on --render-only)."""
    pool = state.workers
    if state.admission is not None and state.admission.draining:
        return Response(
            b'{"status":"draining"}',
            status_code=503,
            media_type="application/json",
            headers={"Retry-After": "1"},
        )
    if pool is None or pool.is_ready():
        return Response(b'{"status":"ready"}', media_type="application/json")
    return Response(
        b'{"status":"not ready","reason":"no gpu-worker is connected and alive"}',
        status_code=503,
        media_type="application/json",
        headers={"Retry-After": "1"},
    )


@router.get("/version")
async def version(state: StateDep) -> VersionResponse:
    """The duet version this server runs."""
    return VersionResponse(version=state.version)


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep) -> Response:
    """Prometheus text exposition of this app's registry."""
    return Response(state.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)
