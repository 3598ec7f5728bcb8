"""Cache-event ingest (``POST /events``). (Instance deregistration and fencing is
``routes_instances.py``.)

``POST /events`` takes LMCache's body ``{"batches": [...]}`` (the shape is documented in
``blendmatch.index.wire`` and in the OpenAPI schema as ``EventRequestModel``). The raw
bytes are handed to the events thread, which decodes the JSON, validates the request as a
whole and applies it through the directory's ingest gate: a malformed request is a 422
naming the field and nothing of it is applied. Per instance, batches must be sent in
emission order; replays and stale incarnations are counted, not errors.

Why not a pydantic body parameter: validating 256 token ids per entry with pydantic costs
more than applying them; the directory's hand-written validator does it in one pass, off
the event loop. ``wire.parse_event_body`` parses the ``token_ids`` arrays straight from the
text into uint32 (``tokens.split_token_arrays``, one ``nogil`` pass) and decodes the rest with
``pydantic_core.from_json``; building a Python int per token used to dominate the ingest cost.
"""

from __future__ import annotations

import logging
import time
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError

from blendmatch.index.key_directory import ApplyReport, KeyDirectory
from blendmatch.index.wire import EventValidationError, parse_event_body

from .context import Ctx, ServiceContext
from .routes_lookup import ERROR_RESPONSES
from .schemas import CacheEventsResponse

__all__ = ["router", "EVENT_REQUEST_SCHEMA_NAME", "answer_events"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["events"])

#: Component name of the ``POST /events`` body schema (added by ``app.build_openapi``).
EVENT_REQUEST_SCHEMA_NAME = "EventRequestModel"


def _decode_and_apply(directory: KeyDirectory, raw: bytes) -> ApplyReport:
    """Events thread: JSON-decode, validate whole, apply. Raises 422-mapped errors."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        request = parse_event_body(raw)  # token_ids straight to uint32; the rest by pydantic-core
    except EventValidationError:
        raise
    except ValueError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(exc)}}]) from None
    return directory.apply_detailed(request)


@router.post(
    "/events",
    response_model=CacheEventsResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{EVENT_REQUEST_SCHEMA_NAME}"}}}}},
)
async def post_events(request: Request, ctx: Ctx) -> Response:
    """Apply a list of cache-event batches (LMCache's ``POST /events``).

    The reply counts batches as LMCache does (``applied``, ``duplicates``, ``stale``) and adds
    ours: ``entries_applied`` (entries of applied batches) and ``entries_not_indexable``
    (applied STORE entries that fed nothing to the blend index, by reason). A malformed
    request is a 422 naming the field, with nothing of it applied."""
    return Response(await answer_events(ctx, await request.body()), media_type="application/json")


async def answer_events(ctx: ServiceContext, raw: bytes) -> bytes:
    """The reply to one ``POST /events`` body (shared by the route and the fast path):
    decoded, validated and applied on the events thread; raises what the handlers map
    (``RequestValidationError``, ``EventValidationError``, ``ServiceError``)."""
    t0 = time.perf_counter()
    report = await ctx.run_event_task(_decode_and_apply, ctx.directory, raw)
    ctx.note_ingested(len(raw))
    counts = report.counts
    ctx.metrics.observe_events(counts.applied, counts.duplicates, counts.stale, time.perf_counter() - t0,
                               report.entries_applied, report.not_indexable)
    reply = CacheEventsResponse(applied=counts.applied, duplicates=counts.duplicates, stale=counts.stale,
                                entries_applied=report.entries_applied, entries_not_indexable=report.not_indexable)
    return reply.__pydantic_serializer__.to_json(reply)


