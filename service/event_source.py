"""The event-source seam: where ``POST /events`` and the registry calls go.

Question answered: "a producer sent events, or an MP server registered, heartbeated or
left: what happens, in this transport?" Routes call :class:`EventSource` and never ask
which transport runs (``ServiceContext.events`` is always one):

- :class:`HttpPushSource` (``--event-transport http``, one node): applied here, on the
  events thread (arrival order), then forwarded to an ``--upstream-coordinator`` if set;
- :class:`KafkaLogSource` (``--event-transport kafka``, N replicas): appended to the log
  (``sources/kafka.py``) and applied by every replica, this one included, as it reads it.

Registry records are applied by the one ``sources.control.apply_control`` in both: HTTP
push calls it with a record built from the request, the Kafka source with the record it
read. Client-supplied strings reach log lines through ``log_safe`` only.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol
from urllib.parse import quote

from fastapi.exceptions import RequestValidationError
from pydantic_core import from_json

from blendmatch.index.key_directory import ApplyReport, KeyDirectory
from blendmatch.index.logsafe import log_safe
from blendmatch.index.wire import EventRequest, EventValidationError, parse_event_body, split_event_body

from .errors import Forbidden, TooManyInstances
from .schemas import CacheEventsResponse
from .sources.control import apply_control
from .sources.instance_bound import apply_within_bound, check_instance_bound
from .sources.records import event_records

if TYPE_CHECKING:
    from .context import ServiceContext

__all__ = ["EventSource", "HttpPushSource", "KafkaLogSource", "MayActFor"]

log = logging.getLogger("blendmatch.service.events")

#: The caller's producer instance patterns (``access.instance_filter``); None: any instance.
MayActFor = Optional[Callable[[str], bool]]


class EventSource(Protocol):
    """One transport's answers to the event and registry routes (see the module docstring)."""

    async def post_events(self, raw: bytes, may_act_for: MayActFor = None) -> bytes:
        """The reply body of one ``POST /events``; raises what the handlers map (422, 403, 429, 503)."""

    async def register(self, fields: Mapping[str, Any]) -> tuple[str, bool]:
        """``POST /instances`` (``RegisterRequest`` fields): ``(instance_id, re_registered)``."""

    async def heartbeat(self, instance_id: str) -> bool:
        """``PUT /instances/{id}/heartbeat``: False for an unknown instance (the route's 404)."""

    async def deregister(self, instance_id: str) -> None:
        """``DELETE /instances/{id}`` (idempotent)."""

    async def reap_once(self) -> list[str]:
        """One reaper sweep: the instances expired (HTTP) or fenced through the log (Kafka)."""


def _missing_body() -> RequestValidationError:
    return RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])


def _json_invalid(exc: ValueError) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": str(exc)}}])


def _check_producer(instance_ids: Any, may_act_for: MayActFor, done: str) -> None:
    """403 when the caller's producer patterns do not match a batch's instance id."""
    if may_act_for is None:
        return
    for i, instance_id in enumerate(instance_ids):
        if not may_act_for(instance_id):
            raise Forbidden(f"body.batches.{i}.instance_id: this credential may not send events for instance "
                            f"{json.dumps(log_safe(instance_id))} (its instance patterns do not match; "
                            f"see docs/security.md); nothing was {done}")


def _decode(raw: bytes, *split: Any) -> EventRequest:
    """A body as a validated request: 422-mapped errors, nothing applied. ``split``: what
    :func:`prepare_body` returned for it, when it ran on the prepare thread."""
    if not raw:
        raise _missing_body()
    try:
        # entries straight to columns, token_ids to uint32, without the GIL; the rest by pydantic-core
        return parse_event_body(raw, arrays=split[0]) if split else parse_event_body(raw)
    except EventValidationError:
        raise
    except ValueError as exc:
        raise _json_invalid(exc) from None


#: Smallest body whose split runs on the prepare thread (:func:`prepare_body`). Measured
#: side by side with 4 posters (docs/performance.md, "Where ingest's time goes"): a 1,000-entry
#: body (1.4 MB, ~3.4 ms of split) gained 10-15% from the overlap; a 64-entry one (90 KB,
#: ~0.2 ms) lost 8-10% to the extra thread hand-offs, so it is split on the events thread.
PREPARE_MIN_BYTES = 256 << 10


def prepare_body(raw: bytes, may_act_for: MayActFor = None) -> Any:
    """The prepare step of an event body of :data:`PREPARE_MIN_BYTES` or more
    (``EventsThread.submit_grouped``): its nogil split (``wire.split_event_body``), run on
    the prepare thread while the events thread applies the bodies ahead of it."""
    return split_event_body(raw)


def decode_and_apply_run(directory: KeyDirectory, bodies: list[tuple[Any, ...]],
                         max_instances: int | None = None) -> list[ApplyReport | Exception]:
    """Events thread: decode and validate each body whole (``bodies``: ``(raw, may_act_for)``,
    or with the body's :func:`prepare_body` result last), check every batch's instance
    id against the caller's producer patterns (``may_act_for``; None: any instance) and the
    bound on tracked instance ids (``max_instances``; None: none), apply. Each body's answer
    is its report or its error (422-mapped, :class:`Forbidden` 403, :class:`TooManyInstances`
    429, nothing of it applied), the same as applying the bodies one at a time, and so is the
    resulting state; but they are applied as few ``KeyDirectory.apply_many`` runs
    (``events_thread.py``). On the events thread, so counts cannot change between a check
    and its apply.

    Decoding and the producer check depend on the body alone; the instance bound is
    :func:`apply_within_bound`'s."""
    out: list[ApplyReport | Exception | None] = [None] * len(bodies)
    requests: list[EventRequest] = []
    where: list[int] = []
    for k, (raw, may_act_for, *split) in enumerate(bodies):
        try:
            request = _decode(raw, *split)
            _check_producer((batch.instance_id for batch in request.batches), may_act_for, "applied")
        except Exception as exc:  # noqa: BLE001 - this body's answer; the others go on
            out[k] = exc
            continue
        requests.append(request)
        where.append(k)
    for k, answer in zip(where, apply_within_bound(directory, requests, max_instances, "applied")):
        out[k] = answer
    return out  # type: ignore[return-value]


class HttpPushSource:
    """HTTP push: every call is applied in this process (see the module docstring)."""

    transport = "http"

    def __init__(self, ctx: "ServiceContext") -> None:
        self._ctx = ctx

    def _control(self, record: Mapping[str, Any]) -> Any:
        ctx = self._ctx
        return apply_control(record, registry=ctx.registry, directory=ctx.directory,
                             instance_events=ctx.metrics.instance_events, max_instances=ctx.config.max_instances)

    async def post_events(self, raw: bytes, may_act_for: MayActFor = None) -> bytes:
        ctx = self._ctx
        ctx.check_compiled()  # 503 while compiling: applying would wait for it
        t0 = time.perf_counter()
        # grouped: bodies that queue up behind a busy events thread are applied as one run
        prepare = prepare_body if len(raw) >= PREPARE_MIN_BYTES else None
        report = await ctx.run_event_group(self._apply_run, (raw, may_act_for), len(raw), prepare)
        ctx.note_ingested(len(raw))
        counts = report.counts
        ctx.metrics.observe_events(counts.applied, counts.duplicates, counts.stale, time.perf_counter() - t0,
                                   report.entries_applied, report.not_indexable)
        if counts.applied or counts.duplicates or counts.stale:  # the same bytes, for the upstream's gate
            ctx.forward("events", "POST", "/events", raw)
        reply = CacheEventsResponse(applied=counts.applied, duplicates=counts.duplicates, stale=counts.stale,
                                    entries_applied=report.entries_applied, entries_not_indexable=report.not_indexable)
        return reply.__pydantic_serializer__.to_json(reply)

    def _apply_run(self, bodies: list[tuple[Any, ...]]) -> list[ApplyReport | Exception]:
        ctx = self._ctx
        return decode_and_apply_run(ctx.directory, bodies, ctx.config.max_instances)

    async def register(self, fields: Mapping[str, Any]) -> tuple[str, bool]:
        out = self._control({**fields, "op": "register"})  # the registry only: no directory lock
        # with the id given here, so that the upstream registers the same instance (not a second generated id)
        self._ctx.forward("register", "POST", "/instances", json.dumps({**fields, "instance_id": out.instance_id}).encode())
        log.info("%s instance %s at %s:%d", "re-registered" if out.re_registered else "registered",
                 log_safe(out.instance_id), log_safe(str(fields["ip"])), fields["http_port"])
        return out.instance_id, out.re_registered

    async def heartbeat(self, instance_id: str) -> bool:
        if not self._control({"op": "heartbeat", "instance_id": instance_id}).applied:
            return False
        self._ctx.forward("heartbeat", "PUT", f"/instances/{quote(instance_id, safe='')}/heartbeat",
                          instance_id=instance_id)
        return True

    async def deregister(self, instance_id: str) -> None:
        ctx = self._ctx
        out = await ctx.run_event_task(self._control, {"op": "deregister", "instance_id": instance_id})
        ctx.forward("deregister", "DELETE", f"/instances/{quote(instance_id, safe='')}")
        log.info("deregistered instance %s (%s): fenced %d L1 placements, %d keys dropped", log_safe(instance_id),
                 "was registered" if out.applied else "was not registered", out.fenced.placements, out.fenced.keys)

    async def reap_once(self) -> list[str]:
        """Expire instances silent for more than ``instance_timeout``, each on the events
        thread (in order with event batches); one that heartbeated since the sweep stays."""
        ctx = self._ctx
        expired = []
        for instance_id, last in ctx.registry.stale():
            out = await ctx.run_event_task(self._control, {"op": "expire", "instance_id": instance_id,
                                                           "last_heartbeat": last})
            if out.applied:
                expired.append(instance_id)
        return expired


class KafkaLogSource:
    """Kafka: every call is appended to the log; every replica applies it from there."""

    transport = "kafka"

    def __init__(self, ctx: "ServiceContext", log_source: Any) -> None:
        self._ctx = ctx
        self.log = log_source  # sources.kafka.KafkaSource

    def _records(self, raw: bytes, may_act_for: MayActFor = None) -> Any:
        """Events thread: the request's LMCache records (validated whole by the source), after
        the same producer instance-pattern check (403) and instance-id bound (429) as HTTP
        mode, nothing appended when either refuses."""
        if not raw:
            raise _missing_body()
        try:
            payload = from_json(raw)
        except ValueError as exc:
            raise _json_invalid(exc) from None
        records = event_records(payload)
        _check_producer((batch["instance_id"] for batch in payload["batches"]), may_act_for, "appended")
        check_instance_bound(self._ctx.directory, (str(b["instance_id"]) for b in payload["batches"]),
                             self._ctx.config.max_instances, "appended")
        return records

    async def post_events(self, raw: bytes, may_act_for: MayActFor = None) -> bytes:
        """Validate the request whole (422 as in HTTP mode, nothing appended), append one
        LMCache record per batch, reply once the broker acknowledged every record:
        ``{"published": N, "topic": T, "records": [{"partition", "offset"}, ...]}`` (200)."""
        records = await self._ctx.run_event_task(self._records, raw, may_act_for)
        return json.dumps(await self.log.publish_events(records), separators=(",", ":")).encode()

    async def register(self, fields: Mapping[str, Any]) -> tuple[str, bool]:
        """Through the log, so that every replica's registry agrees (applied here before the reply)."""
        instance_id = fields["instance_id"] or f"mp-{uuid.uuid4().hex}"
        again = self._ctx.registry.contains(instance_id)
        await self.log.publish_control("register", instance_id,
                                       **{k: v for k, v in fields.items() if k != "instance_id"})
        if not self._ctx.registry.contains(instance_id):  # refused where it applied: the bound
            raise TooManyInstances(f"body.instance_id: registering one more instance than the "
                                   f"{self._ctx.config.max_instances} this server tracks (--max-instances), decided "
                                   "where the registration applied; ids leave when their instance deregisters or "
                                   "expires")
        log.info("%s instance %s at %s:%d (appended to the log)", "re-registered" if again else "registered",
                 log_safe(instance_id), log_safe(str(fields["ip"])), fields["http_port"])
        return instance_id, again

    async def heartbeat(self, instance_id: str) -> bool:
        ctx = self._ctx
        if ctx.registry.contains(instance_id):
            await self.log.publish_control("heartbeat", instance_id, wait_applied=0)
            return True
        # unknown here: nothing to append; counted as HTTP mode counts it
        return apply_control({"op": "heartbeat", "instance_id": instance_id}, registry=ctx.registry,
                             directory=ctx.directory, instance_events=ctx.metrics.instance_events).applied

    async def deregister(self, instance_id: str) -> None:
        await self.log.publish_control("deregister", instance_id)
        log.info("deregistered instance %s (appended to the log)", log_safe(instance_id))

    async def reap_once(self) -> list[str]:
        return await self.log.reap_once()


def build_event_source(ctx: "ServiceContext", log_source: Any = None) -> EventSource:
    """The context's source: Kafka when a log source was built, else HTTP push."""
    return HttpPushSource(ctx) if log_source is None else KafkaLogSource(ctx, log_source)

