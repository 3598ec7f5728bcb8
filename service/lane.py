"""The lookup lane: plain single blend lookups answered by the HTTP protocol itself, with no
ASGI request cycle.

Question answered: "how does a well-formed ``POST /directory/blend-lookup`` get from the
parser to the batcher and back with the least work on the event loop?" Why: the loop is
the pipeline's other stage beside the lookup thread, both on one GIL. After the fast path
(``fastpath.py``) had taken the framework's layers away, uvicorn's own request cycle was
most of what was left: a scope, a cycle object, an ``asyncio.Event``, a task per request
and its steps, the ``receive`` and ``send`` message dicts, the access and fast-path layers'
coroutine frames. Answered from the protocol, the same lookups (wrk, 32 clients, 8,192
tokens over 100,000 chunks) went from 9.8-9.9k to 17.5-18.0k per second in a measurement
prototype, the loop's CPU from 61-63 to 29 us a lookup (``docs/performance.md``, "Why
the lookup lane").

What the lane takes, decided when the request's head is complete (:func:`start`); every
other request goes the usual way, unchanged:

- exactly ``POST /directory/blend-lookup`` (no query string, no ``--root-path``), HTTP/1.1,
  no ``Expect`` or upgrade, not behind a request still being answered on the connection (pipelining is
  uvicorn's);
- the app is this service's own (``app.py``), with its fast path on; uvicorn's access log
  off and no ``limit_concurrency`` (both belong to uvicorn's cycle);
- access control admits it as it is: the very decision of ``access.AccessControl.check``
  (a request it would refuse goes the usual way, and is refused there);
- its headers alone decide nothing (``http_rules.body_rejection``: a length given and
  within ``--max-body-bytes``, a JSON content type).

The body is read by the same parser and the same limits (``limits.py``: header and body
timeouts, bytes in flight) as any request's: a :class:`LaneCycle` stands in the protocol
where uvicorn's cycle would, so the limits, a disconnect and uvicorn's graceful shutdown
treat it as the request in progress. Once the body is complete (:func:`finish`) it is
queued with ``ServiceContext.lookup_nowait`` as it is, a ``DeferredQuery``: the lookup
thread parses and validates it with the fast path's :func:`~.fastpath.parse_body` and
checks it with the route's :func:`~.routes_lookup.checked_query`, with its batch
(:func:`_query`). Why there: the loop is the stage that sets the rate, and the parse was
~6 us of its ~36 us a lookup (``docs/performance.md``, "Why the lookup lane"). The
answer is written with the head uvicorn writes for ``http_rules.send_json``
(:func:`response_head`). Anything else (a body that does not parse, ``include_placements``,
any error raised or returned: a token that does not decode, a limit, not ready yet,
shutting down) hands the request, body complete, to an ordinary uvicorn cycle
(:func:`fall_back`), which answers as the service always has: the route's own status and
words. A lookup is a read, so running it again there changes nothing but time; only
failures pay it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from .access import SCOPE_KEY, Refusal
from .context import DeferredQuery
from .fastpath import parse_body
from .http_rules import body_headers, body_rejection
from .routes_lookup import checked_query
from .schemas import BlendLookupRequest

__all__ = ["LANE_PATH", "Lane", "LaneCycle", "fall_back", "finish", "response_head", "start"]

#: The one path the lane answers.
LANE_PATH = "/directory/blend-lookup"
_LANE_URL = LANE_PATH.encode()


class Lane:
    """What the lane needs of the app (``app.py`` builds it once, with the fast path on):
    the service's context, its access control, and the fast path's body rules."""

    __slots__ = ("context", "access", "limit", "json_paths")

    def __init__(self, context: Any, access: Any, limit: int, json_paths: frozenset[str]) -> None:
        self.context = context
        self.access = access
        self.limit = limit
        self.json_paths = json_paths


class _Resume:
    """The cycle's ``message_event``: where uvicorn's cycle wakes its ``receive``, the lane
    has nobody waiting; but uvicorn pauses reading past 64 KiB of body until ``receive``
    resumes it, so a set resumes reading here (the body is bounded already: its length was
    checked against ``--max-body-bytes`` and it counts toward the bytes in flight)."""

    __slots__ = ("flow", "transport")

    def __init__(self, flow: Any, transport: Any) -> None:
        self.flow = flow
        self.transport = transport

    def set(self) -> None:  # also called on a disconnect: nothing to resume then
        if self.flow.read_paused and not self.transport.is_closing():
            self.flow.resume_reading()

    def clear(self) -> None:
        pass


class _Body:
    """The body as the parser hands it over, in pieces: uvicorn's ``on_body`` adds each
    with ``+=`` and reads ``len``. One piece (the norm for a lookup on loopback) is the body
    itself, with none of the two copies a ``bytearray`` and ``bytes()`` of it make."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0

    def __iadd__(self, piece: bytes) -> "_Body":
        self.pieces.append(piece)
        self.size += len(piece)
        return self

    def __len__(self) -> int:
        return self.size

    def whole(self) -> bytes:
        pieces = self.pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class LaneCycle:
    """The request in progress on a connection while the lane answers it: the attributes of
    uvicorn's ``RequestResponseCycle`` that the protocol, the limits and a shutdown use."""

    __slots__ = ("scope", "body", "more_body", "message_event", "response_started", "response_complete",
                 "disconnected", "keep_alive", "on_response", "_bm_body", "t0")

    def __init__(self, scope: Any, flow: Any, transport: Any, keep_alive: bool) -> None:
        self.scope = scope
        self.body = _Body()
        self.more_body = True
        self.message_event = _Resume(flow, transport)
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = keep_alive
        self.on_response: Any = None
        self._bm_body = 0
        self.t0 = 0.0


def start(proto: Any, lane: Lane) -> bool:
    """At the end of a request's head (``proto``: the connection's protocol, uvicorn's
    ``on_headers_complete`` not run): take the request into the lane, or return False and
    let uvicorn go on as usual. Takes it only as the module docstring lists."""
    parser = proto.parser
    if proto.url != _LANE_URL or parser.get_method() != b"POST" or parser.get_http_version() != "1.1":
        return False
    if proto.expect_100_continue or parser.should_upgrade() or proto.access_log or proto.root_path \
            or proto.limit_concurrency is not None or proto.pipeline:
        return False
    existing = proto.cycle
    if existing is not None and not existing.response_complete:
        return False
    scope = proto.scope
    scope["method"] = "POST"
    scope["path"] = LANE_PATH
    scope["raw_path"] = _LANE_URL
    scope["query_string"] = b""
    verdict = lane.access.check(scope)
    if isinstance(verdict, Refusal):
        return False
    headers = body_headers(scope)
    if headers.length is None or body_rejection(scope, headers, lane.limit, lane.json_paths) is not None:
        return False
    if verdict is not None:
        scope[SCOPE_KEY] = verdict
    cycle = LaneCycle(scope, proto.flow, proto.transport, parser.should_keep_alive())
    proto.cycle = cycle
    proto._bm_active = cycle
    return True


def finish(proto: Any, lane: Lane, cycle: LaneCycle) -> None:
    """The body is complete: queue the lookup, or hand the request to uvicorn's cycle."""
    cycle.more_body = False
    body = cycle.body.whole()
    cycle.t0 = time.perf_counter()  # the latency metric's clock (the route's starts after its parse)
    try:
        got = lane.context.lookup_nowait((DeferredQuery(lambda: _query(lane.context, body), _most_tokens(body)), None))
    except Exception:  # noqa: BLE001 - the usual path answers it, in its own words
        fall_back(proto, cycle, body)
        return
    if isinstance(got, bytes):
        _answer(proto, lane, cycle, got)
        return
    got.add_done_callback(lambda fut: _answered(proto, lane, cycle, body, fut))


def _query(context: Any, body: bytes) -> Any:
    """The lookup in ``body``, as the route would queue it (on the lookup thread, with its
    batch: ``DeferredQuery``); raises for anything the lane leaves to the app."""
    parsed, tokens = parse_body(BlendLookupRequest, body, failures_elsewhere=True)
    if parsed.include_placements:
        raise LookupError("placements: the route's path")
    return checked_query(context, parsed, tokens)


def _most_tokens(body: bytes) -> int:
    """The most tokens ``body`` can carry, the batcher's cost before it is parsed: its bytes
    as a ``tokens_b64`` string when that key opens the body (3 tokens per 16 characters),
    else as the shortest ``token_ids`` list (an id and a comma: 2 bytes)."""
    return len(body) * 3 // 16 + 1 if body.find(b'"tokens_b64"', 0, 256) >= 0 else len(body) // 2 + 1


def _answered(proto: Any, lane: Lane, cycle: LaneCycle, body: bytes, fut: "asyncio.Future[Any]") -> None:
    # the exception is retrieved first, answered or not: a future freed with its exception
    # never retrieved makes asyncio log an ERROR with a traceback
    result = None if fut.cancelled() else (fut.exception() or fut.result())
    if cycle.disconnected or cycle.response_complete:
        if cycle.disconnected:  # the client is gone (the limits released the body's bytes)
            proto.limits.client_gone(proto.client)
        return
    if isinstance(result, bytes):
        _answer(proto, lane, cycle, result)
    else:
        fall_back(proto, cycle, body)


def _answer(proto: Any, lane: Lane, cycle: LaneCycle, payload: bytes) -> None:
    """Write the answer as uvicorn's ``send`` would for ``send_json(send, 200, payload)``,
    then end the request as it does (close unless kept alive, then ``on_response``)."""
    if cycle.disconnected or cycle.response_complete:
        return
    cycle.response_started = True
    transport = proto.transport  # limits' counting transport: one send for head and body
    transport.write_whole(response_head(proto.server_state.default_headers, len(payload), cycle.keep_alive)
                          + payload)
    cycle.response_complete = True
    if not cycle.keep_alive:
        transport.close()
    lane.context.metrics.lookup_latency_single.observe(time.perf_counter() - cycle.t0)
    cycle.on_response()


def response_head(default_headers: Any, length: int, keep_alive: bool) -> bytes:
    """The head uvicorn writes for a 200 with ``http_rules.send_json``'s headers (its
    default headers first, names lower-cased; ``connection: close`` when not kept alive).
    The part before the length is kept while uvicorn's default headers stay the same list
    (it builds a new one when the ``date`` header changes, once a second)."""
    cache = _HEAD_START
    if cache[0] is not default_headers:
        parts = [STATUS_LINE[200]]
        for name, value in default_headers:
            parts += (name.lower(), b": ", value, b"\r\n")
        parts.append(b"content-type: application/json\r\ncontent-length: ")
        cache[:] = [default_headers, b"".join(parts)]
    return cache[1] + (b"%d\r\n\r\n" % length if keep_alive else b"%d\r\nconnection: close\r\n\r\n" % length)


#: ``[uvicorn's default headers list, the head up to the length]`` of the last answer.
_HEAD_START: list[Any] = [None, b""]


def fall_back(proto: Any, cycle: LaneCycle, body: bytes) -> None:
    """Hand the request, its body complete, to an ordinary uvicorn cycle and the app: built
    as uvicorn's ``on_headers_complete`` builds it, its body bytes still counted by the
    limits until its response completes."""
    if cycle.disconnected or cycle.response_complete:
        return
    real = RequestResponseCycle(
        scope=cycle.scope, transport=proto.transport, flow=proto.flow, logger=proto.logger,
        access_logger=proto.access_logger, access_log=proto.access_log,
        default_headers=proto.server_state.default_headers, message_event=asyncio.Event(),
        expect_100_continue=False, keep_alive=cycle.keep_alive, on_response=proto.on_response_complete)
    real.body = bytearray(body)
    real.more_body = False
    real.message_event.set()
    real._bm_body = cycle._bm_body  # type: ignore[attr-defined]
    real.on_response = lambda: proto._bm_cycle_done(real)  # type: ignore[method-assign]
    cycle._bm_body = 0
    cycle.response_complete = True  # it answers nothing now; ``real`` does
    if proto.cycle is cycle:
        proto.cycle = real
    proto._start_asgi_task(real, proto.app)
