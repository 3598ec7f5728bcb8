"""Cache-event ingest (``POST /events``). (Instance deregistration and fencing is
``routes_instances.py``.)

``POST /events`` takes LMCache's body ``{"batches": [...]}`` (the shape is documented in
``blendmatch.index.wire`` and in the OpenAPI schema as ``EventRequestModel``). The raw
bytes go to the context's event source (``event_source.py``; in Kafka mode they are
validated the same way and appended to the log). HTTP push hands them to the events
thread, which decodes the JSON, validates the request as a whole and applies it through the directory's ingest gate: a malformed request is a 422
naming the field and nothing of it is applied. Per instance, batches must be sent in
emission order; replays and stale incarnations are counted, not errors. With
``--upstream-coordinator`` an accepted request's body is then forwarded upstream as it came
(``upstream.py``); the reply never waits for that.

Why not a pydantic body parameter: validating 256 token ids per entry with pydantic costs
more than applying them; the directory's hand-written validator does it in one pass, off
the event loop. ``wire.parse_event_body`` parses the ``token_ids`` arrays straight from the
text into uint32 (``tokens.split_token_arrays``, one ``nogil`` pass) and decodes the rest with
``pydantic_core.from_json``; building a Python int per token used to dominate the ingest cost.
"""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Request, Response

from .access import instance_filter
from .context import Ctx, ServiceContext
from .routes_lookup import ERROR_RESPONSES
from .schemas import CacheEventsResponse

__all__ = ["router", "EVENT_REQUEST_SCHEMA_NAME", "answer_events"]

router = APIRouter(tags=["events"])

#: Component name of the ``POST /events`` body schema (added by ``app.build_openapi``).
EVENT_REQUEST_SCHEMA_NAME = "EventRequestModel"


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
    return Response(await answer_events(ctx, await request.body(), instance_filter(request.scope)),
                    media_type="application/json")


async def answer_events(ctx: ServiceContext, raw: bytes, may_act_for: Callable[[str], bool] | None = None) -> bytes:
    """The reply to one ``POST /events`` body (shared by the route and the fast path):
    decoded, validated, checked against the caller's producer instance patterns
    (``may_act_for``; None: any) and applied on the events thread, or in Kafka mode appended
    to the topic; raises what the handlers map (``RequestValidationError``,
    ``EventValidationError``, ``ServiceError``)."""
    return await ctx.events.post_events(raw, may_act_for)
