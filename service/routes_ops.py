"""Operations endpoints: ``GET /healthz``, ``GET /readyz``, ``GET /metrics``,
``POST /admin/checkpoint``."""

from __future__ import annotations

from fastapi import APIRouter, Response

from .context import Ctx
from .http_rules import HEALTHZ_BODY, json_body
from .metrics import CONTENT_TYPE
from .schemas import HealthResponse

__all__ = ["router"]

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthResponse,
            responses={503: {"description": "not live: `{\"status\": \"unhealthy\", \"reason\": ...}`; restart "
                                            "the process"}})
async def healthz(ctx: Ctx) -> Response:
    """Liveness: ``{"status": "healthy"}`` while the process serves HTTP and, in Kafka mode,
    its log source can go on; 503 with the reason when it cannot (a source thread died, or
    a log reset under ``--on-log-reset fail``), so that an orchestrator restarts it. A
    broker outage is not a reason: the source retries by itself (docs/fleet.md)."""
    problem = ctx.source.health_problem() if ctx.source is not None else None
    if problem is None:
        return Response(HEALTHZ_BODY, media_type="application/json")
    return Response(json_body({"status": "unhealthy", "reason": problem}), status_code=503,
                    media_type="application/json")


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}, "description": "Prometheus text format"}})
async def metrics(ctx: Ctx) -> Response:
    """Prometheus metrics of this app (names prefixed ``blendmatch_``).

    Rendered off the event loop: the scrape-time gauges take the directory's lock, which an
    event batch being applied may hold for a while.
    """
    return Response(await ctx.read(ctx.metrics.render), media_type=CONTENT_TYPE)


@router.get("/readyz", responses={200: {"description": "ready: `{\"status\": \"ready\"}`"},
                                  503: {"description": "not ready: `{\"status\": \"not ready\", \"reasons\": [...]}`"}})
async def readyz(ctx: Ctx) -> Response:
    """Readiness: 503 until the start-up checkpoint restore is done and, when events come
    from a log, until its lag is at most ``--max-ready-lag``; the body says why. Unlike
    ``/healthz`` (liveness), a restoring server is alive but not ready. Failing checkpoints
    add a ``warnings`` list and leave the status as it is: the answers are still right."""
    ready, reasons = ctx.durability.readiness()
    if ctx.fatal is not None:
        ready, reasons = False, [f"fatal: {ctx.fatal}"]
    body: dict[str, object] = {"status": "ready"} if ready else {"status": "not ready", "reasons": reasons}
    warnings = ctx.durability.warnings()  # failing checkpoints: still ready (durability.py says why)
    if warnings:
        body["warnings"] = warnings
    return Response(json_body(body), status_code=200 if ready else 503, media_type="application/json")


@router.post("/admin/checkpoint", responses={409: {"description": "checkpoints are off, or the restore is running"},
                                             500: {"description": "the write failed; the previous checkpoint stands"}})
async def admin_checkpoint(ctx: Ctx) -> Response:
    """Take a checkpoint now (blocks until the file is renamed into place) and say what was
    written: path, bytes, seconds, the ingest pause, counts. 409 when ``--checkpoint-path``
    is empty or the start-up restore has not finished. Needs the ``admin`` role
    (``access.py``'s route table)."""
    dur = ctx.durability
    if not dur.enabled or not dur.restored:
        reason = "checkpoints are off (--checkpoint-path is empty)" if not dur.enabled else "restore in progress"
        return Response(json_body({"detail": reason}), status_code=409, media_type="application/json")
    try:
        result = await ctx.read(dur.checkpoint_now, "admin request")
    except Exception as exc:  # noqa: BLE001 - reported, the previous checkpoint stands
        return Response(json_body({"detail": f"checkpoint failed: {type(exc).__name__}: {exc}"}),
                        status_code=500, media_type="application/json")
    body = {"path": result.path, "bytes": result.bytes, "seconds": result.total_s, "ingest_pause_s": result.pause_s,
            "forked": result.forked, "info": result.info}
    return Response(json_body(body), media_type="application/json")
