"""Running in front of an existing LMCache coordinator (``--upstream-coordinator URL``).

Why: a fleet that relies on LMCache's control plane (L2 quotas, the eviction loop, pins,
prefetch and delete by tokens) can put blendmatch in front of its coordinator and keep all
of that, while blend lookups and the directory are answered here. The MP servers keep one
coordinator URL (blendmatch's); blendmatch splits the traffic:

- **answered here only**: blend lookups, ``/directory/*`` (both forms of
  ``POST /directory/lookup``: the token form is hashed here with ``--hash-algorithm``), the
  registry reads, ``/healthz``, ``/readyz``, ``/metrics``, ``/admin/*``;
- **applied here, then forwarded**: ``POST /events``, ``POST /instances``,
  ``PUT /instances/{id}/heartbeat``, ``DELETE /instances/{id}``. The upstream needs them to
  keep its own directory, LRU and registry current (its eviction picks keys from the
  events; its quota accounting is by placement);
- **proxied** (``Upstream.proxy``): every path this app has no route for
  (``/quota*``, ``/cache/pins``, ``/cache/prefetches*``, ``/cache/delete``, ...): method,
  path, query string, body and content type go up; status, body and content type come
  back.

Forwarding never makes a caller wait on the upstream: after the local apply, the original
body is put on a bounded queue (items and bytes) that one background task drains **in order** (events of an
instance must reach the upstream's gate in emission order; a registration before its
heartbeats). When the queue is full the oldest item is dropped (counted). A transport error
keeps the item and retries with backoff (0.1 s doubling to 5 s) until the upstream answers;
every item is idempotent upstream (an event batch sent twice is a ``duplicate`` at its gate,
a registration twice is a re-registration), so a timeout that hid a success is harmless.
A 429, 500, 502, 503 or 504 is retried up to ``_MAX_5XX_ATTEMPTS`` times, then dropped;
any other error status (a 4xx, a 501) is dropped at once, except a heartbeat's 404 (the
upstream does not know the instance: it restarted, or the registration was dropped): then
the instance's registration is re-sent from the local registry, as LMCache's own
``keep_registered`` would do.

Failures are counted (``blendmatch_upstream_forward_failures_total{kind,reason}``,
``blendmatch_upstream_forward_dropped_total{kind,reason}``,
``blendmatch_upstream_proxy_requests_total{outcome}``) and logged once per burst: the first
failure is a warning, then silence until the upstream answers again, which is logged with
the burst's counts. Nothing here is on the lookup path: an unreachable upstream never delays
a lookup.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.responses import JSONResponse, Response

from blendmatch.index.logsafe import log_safe

__all__ = ["Upstream", "FORWARD_KINDS", "PROXY_METHODS"]

log = logging.getLogger("blendmatch.service.upstream")

#: What is forwarded (the ``kind`` label).
FORWARD_KINDS = ("events", "register", "heartbeat", "deregister")
#: Methods the catch-all proxy route accepts.
PROXY_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")

#: Request headers that travel to the upstream (an allowlist: hop-by-hop headers, ``host``,
#: our own credentials and ``accept-encoding`` stay here; the body is re-framed).
_REQUEST_HEADERS = ("content-type", "accept")
#: Response headers that come back (``content-length`` and ``content-encoding`` are
#: recomputed: httpx has decoded the body).
_RESPONSE_HEADERS = ("content-type", "location", "retry-after", "cache-control")

#: Answers worth another attempt (the upstream is overloaded or restarting); any other error
#: status will not change by resending (501 from a server that has no such endpoint).
_RETRYABLE = frozenset((429, 500, 502, 503, 504))
_MAX_5XX_ATTEMPTS = 3
_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0


@dataclass
class _Item:
    kind: str
    method: str
    path: str
    body: bytes | None
    #: for a heartbeat: the instance, so that a 404 can re-send its registration
    instance_id: str = ""
    attempts: int = 0

    @property
    def size(self) -> int:
        return len(self.body or b"")


class Upstream:
    """The upstream coordinator: one pooled ``httpx.AsyncClient``, the forward queue and its
    drainer task. ``start``/``stop`` from the app lifespan (``ServiceContext``).

    ``registration_of(instance_id)`` returns the ``POST /instances`` body of a locally
    registered instance, or None (used to re-register upstream after a heartbeat's 404).
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, connect_timeout_s: float = 2.0,
                 queue_size: int = 10_000, queue_bytes: int = 256 << 20, registry: CollectorRegistry | None = None,
                 registration_of: Callable[[str], Mapping[str, Any] | None] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = min(float(connect_timeout_s), self.timeout_s)
        self.queue_size = int(queue_size)
        self.queue_bytes = int(queue_bytes)
        self._bytes = 0
        self._registration_of = registration_of
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._queue: collections.deque[_Item] = collections.deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        # burst logging: [failures] since the last success; None while healthy
        self._burst: list[int] | None = None
        self._burst_started = 0.0
        r = registry
        self.forwarded = Counter("blendmatch_upstream_forwarded", "calls forwarded to the upstream coordinator "
                                 "and accepted (2xx)", ["kind"], registry=r)
        self.failures = Counter("blendmatch_upstream_forward_failures", "forward attempts that failed: "
                                "unreachable (connect error, timeout), http_4xx, http_5xx", ["kind", "reason"],
                                registry=r)
        self.dropped = Counter("blendmatch_upstream_forward_dropped", "forwards given up: overflow (queue full, "
                               "oldest dropped), rejected (an error status not worth retrying), gave_up (still failing after retries), "
                               "shutdown",
                               ["kind", "reason"], registry=r)
        self.reregistered = Counter("blendmatch_upstream_reregistrations", "registrations re-sent because the "
                                    "upstream answered a forwarded heartbeat with 404", registry=r)
        self.proxied = Counter("blendmatch_upstream_proxy_requests", "requests proxied to the upstream "
                               "coordinator, by outcome (answered, unreachable, timeout)", ["outcome"], registry=r)
        self.queue_depth = Gauge("blendmatch_upstream_queue_depth", "forwards waiting for the upstream",
                                 registry=r)
        self.queue_depth.set_function(lambda: len(self._queue))
        for kind in FORWARD_KINDS:
            self.forwarded.labels(kind)
            for reason in ("unreachable", "http_4xx", "http_5xx"):
                self.failures.labels(kind, reason)
            self.dropped.labels(kind, "overflow")
        for outcome in ("answered", "unreachable", "timeout"):
            self.proxied.labels(outcome)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=self._transport,
                                         follow_redirects=False, trust_env=False)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        if not self._queue:
            self._idle.set()
        self._task = asyncio.create_task(self._drain_forever(), name="blendmatch-upstream")
        log.info("upstream coordinator %s: unknown endpoints are proxied, events and registry calls forwarded",
                 self.url)

    async def stop(self, flush_s: float | None = None) -> None:
        """Give the queue up to ``flush_s`` (default: the request timeout) to drain, then
        stop; what is left is counted as dropped (``shutdown``) and logged."""
        flush_s = self.timeout_s if flush_s is None else flush_s
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), flush_s)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._queue:
            left = collections.Counter(item.kind for item in self._queue)
            for kind, n in left.items():
                self.dropped.labels(kind, "shutdown").inc(n)
            log.warning("stopping with %d forwards to the upstream coordinator %s not delivered (%s)",
                        len(self._queue), self.url, ", ".join(f"{k} {n}" for k, n in sorted(left.items())))
            self._queue.clear()
            self._bytes = 0
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until the queue is empty and nothing is in flight (tests, shutdown)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ forwarding
    def forward(self, kind: str, method: str, path: str, body: bytes | None = None, *, instance_id: str = "") -> None:
        """Queue one call for the upstream (never waits). Full queue (``queue_size`` items or
        ``queue_bytes`` of bodies): the oldest are dropped until the new one fits."""
        size = len(body or b"")
        while self._queue and (len(self._queue) >= self.queue_size or self._bytes + size > self.queue_bytes):
            old = self._pop_head()
            self.dropped.labels(old.kind, "overflow").inc()
            self._note_failure(f"forward queue full ({len(self._queue) + 1} items, {self._bytes + old.size} "
                               f"bytes); dropping the oldest ({old.kind})")
        self._queue.append(_Item(kind, method, path, body, instance_id))
        self._bytes += size
        self._idle.clear()
        self._wakeup.set()

    async def _drain_forever(self) -> None:
        backoff = _BACKOFF_START_S
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            item = self._queue[0]
            try:
                retry = await self._send(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug must not end forwarding: drop this one, go on
                log.exception("forwarding %s %s to the upstream coordinator failed unexpectedly; dropped",
                              item.method, item.path)
                self.dropped.labels(item.kind, "gave_up").inc()
                retry = False
            if retry:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            backoff = _BACKOFF_START_S
            if self._queue and self._queue[0] is item:  # overflow may have dropped it meanwhile
                self._pop_head()

    def _pop_head(self) -> _Item:
        item = self._queue.popleft()
        self._bytes -= item.size
        return item

    async def _send(self, item: _Item) -> bool:
        """One attempt -> whether to retry the same item."""
        assert self._client is not None
        headers = {"content-type": "application/json"} if item.body is not None else {}
        item.attempts += 1
        try:
            resp = await asyncio.wait_for(
                self._client.request(item.method, item.path, content=item.body, headers=headers), self.timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError, OSError) as exc:
            self.failures.labels(item.kind, "unreachable").inc()
            self._note_failure(f"{item.kind} forward failed: {_why(exc)}")
            return True
        status = resp.status_code
        if status < 400:
            self.forwarded.labels(item.kind).inc()
            self._note_success()
            return False
        if item.kind == "heartbeat" and status == 404:
            return await self._reregister(item)
        reason = "http_5xx" if status >= 500 else "http_4xx"
        if status in _RETRYABLE:
            self.failures.labels(item.kind, reason).inc()
            if item.attempts < _MAX_5XX_ATTEMPTS:
                self._note_failure(f"{item.kind} forward answered {status}; retrying")
                return True
            self.dropped.labels(item.kind, "gave_up").inc()
            self._note_failure(f"{item.kind} forward answered {status} {_MAX_5XX_ATTEMPTS} times; dropped")
            return False
        self.failures.labels(item.kind, reason).inc()
        self.dropped.labels(item.kind, "rejected").inc()
        self._note_failure(f"{item.kind} {item.method} {item.path} rejected by the upstream: {status} "
                           f"{resp.text[:200]}")
        return False

    async def _reregister(self, heartbeat: _Item) -> bool:
        """The upstream does not know an instance we know: send its registration instead of
        the heartbeat (a registration counts as a heartbeat there too)."""
        body = self._registration_of(heartbeat.instance_id) if self._registration_of else None
        if body is None:  # gone here meanwhile: nothing to re-register
            return False
        self.reregistered.inc()
        log.info("upstream coordinator does not know instance %s; re-sending its registration",
                 log_safe(heartbeat.instance_id))
        register = _Item("register", "POST", "/instances", json.dumps(dict(body)).encode())
        if self._queue and self._queue[0] is heartbeat:
            self._pop_head()
        self._queue.appendleft(register)  # (if an overflow dropped the heartbeat meanwhile: still first)
        self._bytes += register.size
        return True  # the register item now at the head goes next (after a short pause)

    # ------------------------------------------------------------------ proxying
    async def proxy(self, method: str, path: str, query: bytes, body: bytes, headers: Mapping[str, str]) -> Response:
        """One request relayed to the upstream and its answer relayed back. Unreachable:
        502; no answer within the timeout: 504 (both JSON ``{"detail": ...}`` naming the
        upstream, counted). Never raises."""
        if self._client is None:
            return JSONResponse({"detail": "the upstream coordinator client is not started"}, status_code=503)
        out_headers = {k: v for k, v in headers.items() if k.lower() in _REQUEST_HEADERS}
        url = path + ("?" + query.decode("latin-1") if query else "")
        try:
            resp = await asyncio.wait_for(
                self._client.request(method, url, content=body or None, headers=out_headers), self.timeout_s)
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            self.proxied.labels("timeout").inc()
            self._note_failure(f"proxied {method} {path}: {_why(exc)}")
            return JSONResponse({"detail": f"upstream coordinator {self.url} did not answer {method} {path} within "
                                           f"{self.timeout_s:g} s"}, status_code=504)
        except (httpx.HTTPError, OSError) as exc:
            self.proxied.labels("unreachable").inc()
            self._note_failure(f"proxied {method} {path}: {_why(exc)}")
            return JSONResponse({"detail": f"upstream coordinator {self.url} is unreachable: {_why(exc)}"},
                                status_code=502)
        self.proxied.labels("answered").inc()
        self._note_success()
        back = {k: v for k, v in resp.headers.items() if k.lower() in _RESPONSE_HEADERS}
        return Response(resp.content, status_code=resp.status_code, headers=back)

    # ------------------------------------------------------------------ burst logging
    def _note_failure(self, what: str) -> None:
        if self._burst is None:
            self._burst = [0]
            self._burst_started = time.monotonic()
            log.warning("upstream coordinator %s: %s (further failures are counted in "
                        "blendmatch_upstream_* and logged when it recovers)", self.url, what)
        self._burst[0] += 1

    def _note_success(self) -> None:
        if self._burst is not None:
            log.warning("upstream coordinator %s answers again after %.1f s and %d failures", self.url,
                        time.monotonic() - self._burst_started, self._burst[0])
            self._burst = None


def _why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
