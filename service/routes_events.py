"""Cache-event ingest (``POST /events``). (Instance deregistration and fencing is
``routes_instances.py``.)

``POST /events`` takes LMCache's body ``{"batches": [...]}`` (the shape is documented in
``blendmatch.index.wire`` and in the OpenAPI schema as ``EventRequestModel``). The raw
bytes are handed to the events thread, which decodes the JSON, validates the request as a
whole and applies it through the directory's ingest gate: a malformed request is a 422
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

import json
import logging
import time
from typing import Any, Callable, Iterable

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic_core import from_json

from blendmatch.index.key_directory import ApplyReport, KeyDirectory
from blendmatch.index.logsafe import log_safe
from blendmatch.index.wire import EventValidationError, parse_event_body

from .access import instance_filter
from .context import Ctx, ServiceContext
from .errors import Forbidden, TooManyInstances
from .routes_lookup import ERROR_RESPONSES
from .schemas import CacheEventsResponse

__all__ = ["router", "EVENT_REQUEST_SCHEMA_NAME", "answer_events"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["events"])

#: Component name of the ``POST /events`` body schema (added by ``app.build_openapi``).
EVENT_REQUEST_SCHEMA_NAME = "EventRequestModel"


def _decode_and_apply(directory: KeyDirectory, raw: bytes, may_act_for: Callable[[str], bool] | None = None,
                      max_instances: int | None = None) -> ApplyReport:
    """Events thread: JSON-decode, validate whole, check every batch's instance id against
    the caller's producer patterns (``may_act_for``; None: any instance) and against the
    bound on tracked instance ids (``max_instances``; None: none), apply. Raises 422-mapped
    errors, :class:`Forbidden` (403) or :class:`TooManyInstances` (429) with nothing applied.
    On the events thread, so the count cannot change between the check and the apply."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        request = parse_event_body(raw)  # token_ids straight to uint32; the rest by pydantic-core
    except EventValidationError:
        raise
    except ValueError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(exc)}}]) from None
    if may_act_for is not None:
        for i, batch in enumerate(request.batches):
            if not may_act_for(batch.instance_id):
                raise Forbidden(f"body.batches.{i}.instance_id: this credential may not send events for instance "
                                f"{json.dumps(log_safe(batch.instance_id))} (its instance patterns do not match; "
                                f"see docs/security.md); nothing was applied")
    if max_instances is not None:
        check_instance_bound(directory, (batch.instance_id for batch in request.batches), max_instances)
    return directory.apply_detailed(request)


def check_instance_bound(directory: KeyDirectory, instance_ids: Iterable[str], max_instances: int,
                         outcome: str = "nothing was applied") -> None:
    """The bound on tracked instance ids (``--max-instances``) for one event request:
    :class:`TooManyInstances` (429) when its ids not tracked yet would take the count of
    instances with an event cursor past the bound. One rule for both transports: in Kafka
    mode it is checked before anything is appended, against this replica's cursors."""
    tracked, new = directory.unknown_instances(instance_ids)
    if new and tracked + len(new) > max_instances:
        raise TooManyInstances(f"body.batches: instance {json.dumps(log_safe(new[0]))} would be one more than the "
                               f"{max_instances} instance ids this server tracks (--max-instances; {tracked} now); "
                               f"ids leave when their instance deregisters or expires; {outcome}")


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
    if ctx.source is not None:  # Kafka mode: append to the topic (docs/fleet.md, reply format there)
        return await _publish(ctx, raw, may_act_for)
    t0 = time.perf_counter()
    report = await ctx.run_event_task(_decode_and_apply, ctx.directory, raw, may_act_for, ctx.config.max_instances)
    ctx.note_ingested(len(raw))
    counts = report.counts
    ctx.metrics.observe_events(counts.applied, counts.duplicates, counts.stale, time.perf_counter() - t0,
                               report.entries_applied, report.not_indexable)
    if counts.applied or counts.duplicates or counts.stale:  # the same bytes, for the upstream's gate
        ctx.forward("events", "POST", "/events", raw)
    reply = CacheEventsResponse(applied=counts.applied, duplicates=counts.duplicates, stale=counts.stale,
                                entries_applied=report.entries_applied, entries_not_indexable=report.not_indexable)
    return reply.__pydantic_serializer__.to_json(reply)


def _records(source: Any, raw: bytes, may_act_for: Callable[[str], bool] | None = None,
             directory: KeyDirectory | None = None, max_instances: int | None = None) -> Any:
    """Kafka mode: the request's LMCache records (validated whole by the source), after the
    same producer instance-pattern check (403) and instance-id bound (429) as HTTP mode,
    nothing appended when either refuses."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        payload = from_json(raw)
    except ValueError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(exc)}}]) from None
    records = source.event_records(payload)
    if may_act_for is not None:
        for i, batch in enumerate(payload["batches"]):
            if not may_act_for(batch["instance_id"]):
                raise Forbidden(f"body.batches.{i}.instance_id: this credential may not send events for instance "
                                f"{json.dumps(log_safe(batch['instance_id']))} (its instance patterns do not "
                                "match; see docs/security.md); nothing was appended")
    if directory is not None and max_instances is not None:
        check_instance_bound(directory, (str(b["instance_id"]) for b in payload["batches"]), max_instances,
                             "nothing was appended")
    return records


async def _publish(ctx: Any, raw: bytes, may_act_for: Callable[[str], bool] | None = None) -> bytes:
    """Kafka mode: validate the request whole (422 as in HTTP mode, nothing appended), append
    one LMCache record per batch, reply once the broker acknowledged every record:
    ``{"published": N, "topic": T, "records": [{"partition", "offset"}, ...]}`` (200). This
    replica applies the batches when it consumes them, like every other replica."""
    records = await ctx.run_event_task(_records, ctx.source, raw, may_act_for, ctx.directory, ctx.config.max_instances)
    return json.dumps(await ctx.source.publish_events(records), separators=(",", ":")).encode()
