"""Per-connection and global HTTP limits, enforced inside the server's protocol while bytes
are read: before any request reaches the app, access control included.

Question answered: "can a handful of hostile or broken clients take this server off the
network or out of memory?" No: every connection is bounded in header bytes and in time, the
number of connections is bounded, and the bytes held for requests in flight across all
connections are bounded. uvicorn bounds none of these (a 100 MB header is buffered whole,
a silent connection is never closed, and bodies and unread responses are held without a
global cap), so :class:`HttpLimits` hands uvicorn a subclass of its own ``httptools``
protocol (``uvicorn.Config(http=limits.protocol_class)``) that counts while it reads.

=====================  =========================  ======  ===========================================
limit                  setting (default)          answer  what it bounds
=====================  =========================  ======  ===========================================
header bytes           ``max_header_bytes``       431     request line + headers of one request; never
                       (64 KiB)                           more than this is handed to the parser
header time            ``header_timeout`` (10 s)  408     from connect (or a request's first byte) to
                                                          its blank line; a connection that sent
                                                          nothing is closed without an answer
body time              ``body_timeout`` (30 s)    408     from the end of the headers to the last
                                                          body byte (total, not per read: a body
                                                          trickled a byte at a time cannot last)
connections            ``max_connections``        503     open connections; one over is answered and
                       (1,000)                            closed at once, before it is read
bytes in flight        ``max_bytes_in_flight``    503     body bytes received for requests not yet
                       (256 MiB)                          answered, plus response bytes written but
                                                          not yet taken by the client, summed over
                                                          every connection
=====================  =========================  ======  ===========================================

Every refusal has a JSON body ``{"detail": "..."}`` naming the limit and its setting, and
``connection: close``; the refused connection then *lingers* (input read and discarded, at
most :data:`LINGER_S`) so that a client still sending sees the answer instead of a reset.
A response already under way cannot be replaced: a connection whose unread responses push
the total over ``max_bytes_in_flight`` is aborted (its buffer freed at once). A request
that is over the bytes-in-flight bound gets 503: the server is loaded, not the request
wrong, so a retry elsewhere or later is right.

The same protocol answers requests that the HTTP parser rejects (a bad ``Content-Length``,
a malformed request line) with a JSON 400 naming the parser's reason, instead of uvicorn's
plain-text body, and tells the request being answered when its client went away (uvicorn
tells only the newest of pipelined requests; the one being answered then wrote to a closed
transport and logged an ERROR traceback per connection).

Each refusal is counted in ``blendmatch_http_limit_rejections_total{limit}`` (and in
``blendmatch_http_rejected_total{status}`` through ``on_reject``), and logged at WARNING at
most once per :data:`LOG_INTERVAL_S` per limit, with the number of refusals since the last
line. Gauges: ``blendmatch_http_connections`` and ``blendmatch_http_bytes_in_flight``.

Time limits are checked by one timer per server (every quarter of the smaller timeout, at
most once a second), not by a timer per request: the hot path pays a few attribute writes.
A connection whose reading uvicorn paused (a pipelined request waiting for the one before
it, a body the app has not consumed yet) is waiting for the server, not the other way round:
its clock is restarted instead of refusing it.

Everything here runs on the event loop thread; no locks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from http import HTTPStatus
from typing import Any, Callable

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .counting_transport import CountingTransport
from .lane import Lane, LaneCycle
from .lane import finish as lane_finish
from .lane import start as lane_start
from .ratelog import RateLimitedLog

__all__ = ["HttpLimits", "LINGER_S", "LOG_INTERVAL_S", "LIMIT_KINDS", "raise_open_file_limit"]

log = logging.getLogger("blendmatch.service.limits")

#: How long a refused connection keeps reading (and discarding) before it is closed, so that a
#: client in the middle of sending reads the answer rather than a connection reset.
LINGER_S = 1.0
#: At most one WARNING per limit per this many seconds (a flood must not flood the log).
LOG_INTERVAL_S = 10.0
#: The ``limit`` label values of ``blendmatch_http_limit_rejections_total``.
LIMIT_KINDS = ("header_bytes", "header_timeout", "body_timeout", "connections", "bytes_in_flight",
               "malformed")


def _answer(status: int, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, HTTPStatus(status).phrase.encode(), len(body))) + body


class HttpLimits:
    """The limits of one server (module docstring). Give ``protocol_class`` to uvicorn as
    ``http=``; the first connection starts the timer on the server's loop.

    ``registry``: the Prometheus registry for the gauges and the counter (None: none).
    ``on_reject(status)``: called once per refusal answered (the app's rejected counter).
    """

    def __init__(self, *, max_header_bytes: int, header_timeout: float, body_timeout: float, max_connections: int,
                 max_bytes_in_flight: int, registry: Any = None,
                 on_reject: Callable[[int], None] | None = None) -> None:
        if max_header_bytes < 256 or max_connections < 1 or max_bytes_in_flight < 1:
            raise ValueError("max_header_bytes >= 256, max_connections >= 1 and max_bytes_in_flight >= 1 needed, "
                             f"got {max_header_bytes}, {max_connections}, {max_bytes_in_flight}")
        if not (header_timeout > 0 and body_timeout > 0):
            raise ValueError(f"timeouts must be > 0, got {header_timeout}, {body_timeout}")
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.max_bytes_in_flight = max_bytes_in_flight
        self.tick_s = min(1.0, max(0.02, min(header_timeout, body_timeout) / 4))
        self.open: set[_LimitedProtocol] = set()
        self.in_flight = 0
        self.refusals: dict[str, int] = dict.fromkeys(LIMIT_KINDS, 0)
        self._on_reject = on_reject
        self._log = RateLimitedLog(log, LOG_INTERVAL_S)
        self._timer: asyncio.TimerHandle | None = None
        self._counter: Any = None
        if registry is not None:
            from prometheus_client import Counter, Gauge

            Gauge("blendmatch_http_connections", "open HTTP connections (refused ones not included)",
                  registry=registry).set_function(lambda: len(self.open))
            Gauge("blendmatch_http_bytes_in_flight", "request body bytes held for unanswered requests plus "
                  "response bytes not yet taken by clients, over all connections",
                  registry=registry).set_function(lambda: self.in_flight)
            self._counter = Counter("blendmatch_http_limit_rejections",
                                    "connections or requests refused by an HTTP limit", ["limit"], registry=registry)
            for kind in LIMIT_KINDS:
                self._counter.labels(kind)
        self.protocol_class: type[HttpToolsProtocol] = type("LimitedHttpToolsProtocol", (_LimitedProtocol,),
                                                            {"limits": self})

    @classmethod
    def from_config(cls, config: Any, *, registry: Any = None,
                    on_reject: Callable[[int], None] | None = None) -> "HttpLimits":
        """The limits a ``ServiceConfig`` sets."""
        return cls(max_header_bytes=config.max_header_bytes, header_timeout=config.header_timeout,
                   body_timeout=config.body_timeout, max_connections=config.max_connections,
                   max_bytes_in_flight=config.max_bytes_in_flight, registry=registry, on_reject=on_reject)

    # ------------------------------------------------------------------ bookkeeping
    def refused(self, kind: str, status: int | None, peer: Any, message: str, *args: Any) -> None:
        self.refusals[kind] += 1
        if self._counter is not None:
            self._counter.labels(kind).inc()
        if status is not None and self._on_reject is not None:
            self._on_reject(status)
        self._log.warn(kind, "%s: " + message, _peer(peer), *args)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = loop.call_later(self.tick_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = time.monotonic()
        for conn in list(self.open):
            conn._bm_check(now)
        if self.open:
            self._arm(loop)


def _peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "peer unknown"


class _LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HttpLimits` applied (module docstring).
    ``limits`` is set on the subclass :class:`HttpLimits` builds."""

    limits: HttpLimits

    # Per connection (set in connection_made): _bm_hdr_open (reading a request's head),
    # _bm_hdr_bytes, _bm_phase (bumped at each head/message end), _bm_hdr_deadline and
    # _bm_body_deadline (monotonic, or None), _bm_body (body bytes held), _bm_out (response
    # bytes accounted), _bm_refused (answered and lingering: input discarded).

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        self._bm_raw = transport
        self._bm_hdr_open = True
        self._bm_hdr_bytes = 0
        self._bm_phase = 0
        self._bm_got_bytes = False
        self._bm_hdr_deadline: float | None = time.monotonic() + limits.header_timeout
        self._bm_body_deadline: float | None = None
        self._bm_body = 0
        self._bm_out = 0
        self._bm_refused = False
        self._bm_linger: asyncio.TimerHandle | None = None
        self._bm_active: Any = None
        self._bm_idle_deadline: float | None = None  # keep-alive: closed at this time if still idle
        # the lookup lane: this service's app with its fast path on (lane.py), else None
        self._bm_lane: Lane | None = getattr(self.app, "blendmatch_lane", None)
        if len(limits.open) >= limits.max_connections:
            self._bm_refused = True
            limits.refused("connections", 503, self.client, "refused a connection: %d open (--max-connections)",
                           len(limits.open))
            transport.write(_answer(503, f"too many connections: {len(limits.open)} open, the limit is "
                                         f"{limits.max_connections} (--max-connections); retry later"))
            transport.close()
            return
        self.transport = CountingTransport(transport, self)  # type: ignore[assignment]
        limits.open.add(self)
        limits._arm(self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn marks only the newest request disconnected; with pipelining the one being
        # answered is older and would go on writing to a closed transport (uvloop raises:
        # an ERROR with a traceback per connection). It learns of the disconnect too.
        active = self._bm_active
        if active is not None and not active.response_complete:
            active.disconnected = True
            active.message_event.set()
        limits = self.limits
        if self in limits.open:
            limits.open.discard(self)
            limits.in_flight -= self._bm_body + self._bm_out
            self._bm_body = self._bm_out = 0
        if self._bm_linger is not None:
            self._bm_linger.cancel()
            self._bm_linger = None
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._bm_refused:  # the client has read the answer and is done: close now
            self._bm_raw.close()
        return None

    # ------------------------------------------------------------------ reading
    def data_received(self, data: bytes) -> None:
        self._bm_idle_deadline = None  # a request is coming: the connection is not idle
        if self._bm_refused:
            return  # lingering: read and dropped
        if self._bm_hdr_open:
            if self._bm_hdr_deadline is None:
                self._bm_hdr_deadline = time.monotonic() + self.limits.header_timeout
            self._bm_got_bytes = True
            room = self.limits.max_header_bytes - self._bm_hdr_bytes
            if len(data) > room:
                phase = self._bm_phase
                self._bm_hdr_bytes += room
                self._bm_feed(data[:room])
                if self._bm_refused or self._bm_raw.is_closing():
                    return
                if self._bm_phase == phase:  # the head did not end within the limit
                    self._bm_refuse(431, "header_bytes",
                                    f"request headers are over the limit of {self.limits.max_header_bytes} bytes "
                                    "(--max-header-bytes)")
                    return
                self.data_received(data[room:])
                return
            self._bm_hdr_bytes += len(data)
        self._bm_feed(data)

    def _bm_feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, with a JSON 400 for what the parser rejects."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            if self._bm_refused:  # a refusal during this feed already answered
                return
            reason = str(exc) or type(exc).__name__
            self._bm_refuse(400, "malformed", f"malformed HTTP request: {reason}")

    def send_400_response(self, msg: str) -> None:
        self._bm_refuse(400, "malformed", f"malformed HTTP request: {msg}")

    def on_headers_complete(self) -> None:
        if self._bm_refused:
            return
        limits = self.limits
        if limits.in_flight > limits.max_bytes_in_flight:  # refused as a new request (nothing answered yet)
            self._bm_refuse(503, "bytes_in_flight", self._bm_busy_detail())
            return
        self._bm_hdr_open = False
        self._bm_hdr_deadline = None
        self._bm_phase += 1
        lane = self._bm_lane
        if lane is None or not lane_start(self, lane):  # the lookup lane (lane.py) or uvicorn's cycle
            super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:  # a WebSocket upgrade: not ours to count
            return
        cycle._bm_body = 0  # type: ignore[attr-defined]
        cycle.on_response = lambda: self._bm_cycle_done(cycle)  # type: ignore[method-assign]
        self._bm_body_deadline = time.monotonic() + limits.body_timeout

    def on_body(self, body: bytes) -> None:
        if self._bm_refused:
            return
        limits = self.limits
        cycle = self.cycle
        if cycle.response_complete:  # answered already (a 413 before the body ended): uvicorn drops it
            return
        n = len(body)
        cycle._bm_body += n  # type: ignore[attr-defined]
        self._bm_body += n
        limits.in_flight += n
        if limits.in_flight > limits.max_bytes_in_flight:
            self._bm_refuse(503, "bytes_in_flight", self._bm_busy_detail())
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._bm_refused:
            return
        self._bm_hdr_open = True
        self._bm_hdr_bytes = 0
        self._bm_got_bytes = False
        self._bm_body_deadline = None
        self._bm_phase += 1
        super().on_message_complete()
        cycle = self.cycle
        if type(cycle) is LaneCycle and not cycle.response_complete:
            lane_finish(self, self._bm_lane, cycle)

    def handle_websocket_upgrade(self) -> None:
        """The connection leaves HTTP (and these limits): its slot and bytes are released
        here, since its ``connection_lost`` will go to the WebSocket protocol. (``blendmatch
        serve`` runs with ``ws="none"``; this is for an embedding that serves WebSockets.)"""
        limits = self.limits
        if self in limits.open:
            limits.open.discard(self)
            limits.in_flight -= self._bm_body + self._bm_out
            self._bm_body = self._bm_out = 0
        self._bm_refused = True  # no deadline or accounting for it any more
        super().handle_websocket_upgrade()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._bm_active = cycle  # the request being answered (self.cycle may be a pipelined one)
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        """uvicorn's, except for the keep-alive timeout: where uvicorn arms a timer per
        response (``call_later``) that the next request's bytes cancel, a deadline is kept
        here and the limits' tick closes the connection once it passes (``_bm_check``).
        The timer and its cancel cost 1.8 us a request on uvloop, about 5% of a lookup's
        event-loop time; an idle connection now closes up to one tick (at most 1 s) after
        ``--timeout-keep-alive`` instead of at it."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request waits: start it
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._bm_idle_deadline = time.monotonic() + self.timeout_keep_alive

    def _bm_cycle_done(self, cycle: Any) -> None:
        """A response was completed: its body bytes are no longer held. The cycle's
        ``on_response`` (a closure over the cycle itself) is dropped here: left in place, it
        made every request a reference cycle, and the garbage collector's passes over them
        took about 6% of the event loop under wrk's lookups (issue 28, twelfth round)."""
        cycle.on_response = _responded
        n = cycle._bm_body
        cycle._bm_body = 0
        self._bm_body -= n
        self.limits.in_flight -= n
        self.on_response_complete()

    def _bm_busy_detail(self) -> str:
        limits = self.limits
        return (f"server busy: {limits.in_flight} request and response bytes in flight, over the limit of "
                f"{limits.max_bytes_in_flight} (--max-bytes-in-flight); retry later")

    # ------------------------------------------------------------------ writing
    def _bm_account_out(self) -> None:
        """Re-read this connection's unsent response bytes; over the global bound -> abort."""
        size = self._bm_raw.get_write_buffer_size()
        delta = size - self._bm_out
        if not delta:
            return
        self._bm_out = size
        limits = self.limits
        limits.in_flight += delta
        if delta > 0 and limits.in_flight > limits.max_bytes_in_flight and self in limits.open:
            limits.refused("bytes_in_flight", None, self.client,
                           "aborted a connection holding %d unread response bytes: %d bytes in flight "
                           "(--max-bytes-in-flight %d)", size, limits.in_flight, limits.max_bytes_in_flight)
            self._bm_drop_cycles()
            self._bm_refused = True
            self._bm_raw.abort()

    def resume_writing(self) -> None:
        self._bm_account_out()
        super().resume_writing()

    # ------------------------------------------------------------------ timers and refusals
    def _bm_check(self, now: float) -> None:
        """Called by the server's timer: refresh the write accounting, apply the deadlines."""
        if self._bm_refused:
            return
        idle = self._bm_idle_deadline
        if idle is not None and now >= idle:  # kept alive and idle past --timeout-keep-alive
            self._bm_idle_deadline = None
            self.timeout_keep_alive_handler()
            return
        self._bm_account_out()
        if self._bm_refused:
            return
        limits = self.limits
        for attr, kind, what, setting in (("_bm_hdr_deadline", "header_timeout", "headers", "--header-timeout"),
                                          ("_bm_body_deadline", "body_timeout", "body", "--body-timeout")):
            deadline = getattr(self, attr)
            if deadline is None or now < deadline:
                continue
            if self.flow.read_paused:  # the server paused reading: the wait is ours, not the client's
                setattr(self, attr, now + getattr(limits, kind))
                continue
            if kind == "header_timeout" and not self._bm_got_bytes:  # silent: closed, nothing to answer
                limits.refused(kind, None, self.client, "closed a connection that sent nothing for %g s "
                               "(--header-timeout)", limits.header_timeout)
                self._bm_drop_cycles()
                self._bm_refused = True
                self._bm_raw.close()
                return
            self._bm_refuse(408, kind, f"request {what} not received within {getattr(limits, kind):g} s ({setting})")
            return

    def _bm_drop_cycles(self) -> None:
        """The request in progress (if any) sees a disconnect; its answer and any pipelined
        request are dropped; its body bytes are released."""
        for cycle in (self._bm_active, self.cycle):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self.pipeline.clear()
        limits = self.limits
        if self in limits.open:
            limits.in_flight -= self._bm_body
            self._bm_body = 0
        self._bm_hdr_deadline = self._bm_body_deadline = None

    def _bm_refuse(self, status: int, kind: str, detail: str) -> None:
        """Answer ``status`` and close after a linger; abort instead when a response is being
        written (an answer cannot be spliced into it); close without an answer when the
        request being refused was answered already (the app's 413 before its body ended)."""
        active, cycle = self._bm_active, self.cycle
        started = active is not None and active.response_started and not active.response_complete
        answered = not self._bm_hdr_open and cycle is not None and cycle.response_complete
        self.limits.refused(kind, status, self.client, "%d %s", status, detail)
        self._bm_drop_cycles()
        self._bm_refused = True
        raw = self._bm_raw
        if raw.is_closing():
            return
        if started:
            raw.abort()
            return
        if answered:
            raw.close()
            return
        raw.write(_answer(status, detail))
        if raw.can_write_eof():
            raw.write_eof()
        self._bm_linger = self.loop.call_later(LINGER_S, raw.close)


def _responded() -> None:
    """A completed cycle's ``on_response``: uvicorn calls it once, at the response's end."""


#: File descriptors kept for everything that is not a client connection (listening sockets,
#: the checkpoint writer, Kafka, log files) when sizing the open-file limit.
RESERVED_FDS = 128


def raise_open_file_limit(max_connections: int) -> None:
    """Raise the soft open-file limit so that ``max_connections`` connections fit (up to the
    hard limit); warn when they cannot. Without it a process with the usual soft limit of
    1,024 fails ``accept()`` before the connection limit could answer a clear 503."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("the open-file limit (%d) is below --max-connections %d + %d: connections past about %d fail "
                    "at accept() instead of getting a 503; raise `ulimit -n` or lower --max-connections", soft,
                    max_connections, RESERVED_FDS, soft - RESERVED_FDS)
