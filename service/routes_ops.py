"""Operations endpoints: ``GET /healthz`` and ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Response

from .context import Ctx
from .metrics import CONTENT_TYPE
from .schemas import HealthResponse

__all__ = ["router"]

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthResponse)
async def healthz() -> Response:
    """Liveness: ``{"status": "healthy"}`` while the process serves HTTP."""
    return Response(b'{"status":"healthy"}', media_type="application/json")


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}, "description": "Prometheus text format"}})
async def metrics(ctx: Ctx) -> Response:
    """Prometheus metrics of this app (names prefixed ``blendmatch_``).

    Rendered off the event loop: the scrape-time gauges take the directory's lock, which an
    event batch being applied may hold for a while.
    """
    return Response(await ctx.read(ctx.metrics.render), media_type=CONTENT_TYPE)
