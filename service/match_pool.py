"""Submit-once / poll-later blend matching: the worker pool behind ``BlendClient.submit_match``.

Which question it answers: how does a serving engine's scheduler thread ask the directory
"which cached chunks does this request contain?" without ever waiting on the network?
It submits the query (returns at once), goes on scheduling, and polls on its next pass.
This is the pattern LMCache 0.5.6's blend module drives (``submit_match`` / ``poll_match``
/ ``take_match``); :class:`MatchPool` implements it, transport-free: the caller hands it a
:class:`MatchWire` that encodes and sends queries.

Contract (what a poller may rely on):

- An entry per request id, created by the first submit and removed by ``take``. A second
  submit for an id that has an entry is a no-op (idempotent), whatever its tokens.
- ``poll`` returns ``None`` (no entry: never submitted, or taken), :data:`PENDING` (in flight)
  or a ``list[BlendMatch]`` (the answer; ``[]`` is a miss *or* a failure).
- Every entry resolves within its budget (``budget_s`` from submit, queue wait included):
  past it, ``poll`` answers ``[]`` even while the round trip is still out. So a black-hole
  server costs a request its budget, never a hang.
- Failures never reach the caller: connection refused, timeouts, error statuses, malformed
  answers all resolve the affected entries to ``[]`` and log one warning per failure
  (identical warnings are rate-limited: at most one per :data:`WARN_INTERVAL_S`, with a count
  of the ones held back). Nothing on the submit/poll/take path raises.
- A late answer (its entry was taken, or taken and re-submitted) is discarded: an answer is
  delivered only to the very entry object it was sent for.
- Queries shorter than ``chunk_size`` cannot contain a chunk: they resolve ``[]`` at submit,
  without a round trip.

Coalescing (beyond LMCache's client): ``workers`` threads pull from one FIFO queue; a worker
that becomes free takes *everything queued* (up to ``max_batch_tokens`` tokens and
:data:`MAX_BATCH_QUERIES` queries) and sends it as one ``/directory/blend-lookup/batch``
request; a lone query goes to the plain LMCache endpoint. No query waits for company: an
idle worker sends at once, so coalescing costs nothing when the engine is quiet and saves
round trips when it is busy. If the server has no batch endpoint (LMCache's own coordinator
answers 404), the pool says so once and sends one request per query from then on.

Locking: one lock guards the entries and the queue; no I/O and no logging happen under it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol, Sequence

from blendmatch.index.types import BlendMatch, BlendNamespace

__all__ = ["PENDING", "BatchUnsupported", "MatchPool", "MatchWire", "WarnLimiter", "as_namespace"]

logger = logging.getLogger("blendmatch.service.client")

#: Identical warnings (same kind, same reason) are logged at most once per this many seconds;
#: the next one says how many were held back. A fleet-wide outage would otherwise log one line
#: per request (thousands per second).
WARN_INTERVAL_S = 30.0

#: Most queries in one coalesced request. The token budget is the real bound; this one only
#: keeps a flood of tiny queries from building one huge JSON body.
MAX_BATCH_QUERIES = 256


class _PendingMarker:
    """The type of :data:`PENDING` when LMCache is not loaded (a named, truthy singleton)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PENDING"

    def __reduce__(self) -> str:
        return "PENDING"


def _lmcache_pending() -> object | None:
    """LMCache's own ``PENDING`` when this process already runs LMCache, else ``None``.

    Why: LMCache's blend module tests ``poll is PENDING`` against *its* sentinel. Swapping in
    this client with one import line only works if ours is the same object, so we adopt
    theirs. We never import LMCache ourselves (it pulls in torch): only when ``lmcache`` is
    already in ``sys.modules``, which is always true inside an LMCache MP server.
    """
    if "lmcache" not in sys.modules:
        return None
    try:
        from lmcache.v1.mp_coordinator.blend_client import PENDING as theirs  # type: ignore[import-not-found]
    except Exception:  # an LMCache without the blend client, or one that fails to import
        return None
    return theirs


#: ``poll_match`` answer for a query still in flight: distinct from ``None`` and from any list.
#: Compare with ``is``. Inside an LMCache process this *is* LMCache's sentinel.
PENDING: object = _lmcache_pending()
if PENDING is None:
    PENDING = _PendingMarker()


class BatchUnsupported(Exception):
    """Raised by :meth:`MatchWire.lookup_many` when the server has no batch endpoint."""


class MatchWire(Protocol):
    """How the pool reaches the server. Every method may raise; the pool catches."""

    def encode(self, tokens: Any, namespace: BlendNamespace) -> dict[str, Any]:
        """The request body of one query (runs on a worker thread)."""

    def lookup_one(self, body: dict[str, Any]) -> list[BlendMatch]:
        """Answer one query with one request."""

    def lookup_many(self, bodies: Sequence[dict[str, Any]]) -> list[list[BlendMatch]]:
        """Answer many queries with one request, in order; :class:`BatchUnsupported` if the
        server has no batch endpoint."""


def as_namespace(namespace: Any) -> BlendNamespace:
    """Our ``BlendNamespace`` from ours, LMCache's (any object with ``model_name``,
    ``cache_salt``, ``world_size``) or a bare model name.

    Why duck typing: LMCache's MP server passes its own frozen dataclass; importing it would
    import LMCache.
    """
    if isinstance(namespace, BlendNamespace):
        return namespace
    if isinstance(namespace, str):
        return BlendNamespace(namespace)
    return BlendNamespace(str(namespace.model_name), str(getattr(namespace, "cache_salt", "")),
                          int(getattr(namespace, "world_size", 1)))


class WarnLimiter:
    """Log a warning once per ``interval_s`` per key; count the ones held back."""

    def __init__(self, log: logging.Logger = logger, interval_s: float = WARN_INTERVAL_S,
                 max_keys: int = 256) -> None:
        self._log, self._interval, self._max_keys = log, interval_s, max_keys
        self._lock = threading.Lock()
        self._seen: dict[Hashable, tuple[float, int]] = {}  # key -> (last logged at, held back)

    def warn(self, key: Hashable, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self._interval:
                self._seen[key] = (last, held + 1)
                return
            if len(self._seen) >= self._max_keys:  # reasons that vary (ports, ids): stay bounded
                self._seen.clear()
            self._seen[key] = (now, 0)
        if held:
            msg += " (%d similar warnings in the last %.0f s not logged)"
            args = (*args, held, self._interval)
        self._log.warning(msg, *args)


@dataclass(eq=False, slots=True)
class _Entry:
    """One submitted query. Compared by identity: a late answer must find *this* object."""

    rid: Hashable
    tokens: Any
    namespace: BlendNamespace
    deadline: float
    n_tokens: int
    result: object = PENDING
    done: threading.Event = field(default_factory=threading.Event)


_STATS = ("submitted", "short", "requests", "batch_requests", "queries_sent", "answered", "failed",
          "expired", "discarded")


class MatchPool:
    """The entries, the queue and the worker threads (see the module docstring)."""

    def __init__(self, wire: MatchWire, *, workers: int, budget_s: float, chunk_size: int,
                 coalesce: bool = True, max_batch_tokens: int = 262_144,
                 warn: WarnLimiter | None = None) -> None:
        if workers < 1:
            raise ValueError(f"match_concurrency must be >= 1, got {workers}")
        self._wire, self._budget = wire, budget_s
        #: Queries shorter than this resolve ``[]`` at submit (the chunk size; settable once
        #: learned from the server).
        self.min_tokens = chunk_size
        self._coalesce, self._max_tokens = coalesce, max_batch_tokens
        self._warn = warn or WarnLimiter()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._entries: dict[Hashable, _Entry] = {}
        self._queue: deque[_Entry] = deque()
        self._closed = False
        self._stats = dict.fromkeys(_STATS, 0)
        self._threads = [threading.Thread(target=self._run, name=f"blendmatch-match-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ caller's path
    def submit(self, rid: Hashable, tokens: Any, namespace: Any) -> None:
        """Queue a query for ``rid`` unless it has an entry. Returns at once; never raises.
        After :meth:`close` a submit is ignored (the id stays unknown)."""
        try:
            self._submit(rid, tokens, namespace)
        except Exception as exc:  # unhashable id, tokens without a length, odd namespace...
            reason = _reason(exc)
            self._warn.warn(("submit", reason), "blend match submit for %r failed, answering no matches: %s",
                            rid, reason)

    def _submit(self, rid: Hashable, tokens: Any, namespace: Any) -> None:
        try:
            n, ns = len(tokens), as_namespace(namespace)
        except Exception:
            self._add_resolved(rid, [])  # the caller polls a miss, not an unknown id
            raise
        entry = _Entry(rid, tokens, ns, time.monotonic() + self._budget, n)
        with self._lock:
            if rid in self._entries or self._closed:
                return
            self._entries[rid] = entry
            self._stats["submitted"] += 1
            if n < self.min_tokens:
                self._stats["short"] += 1
                self._resolve_locked(entry, [])
                return
            self._queue.append(entry)
            self._work.notify()

    def _add_resolved(self, rid: Hashable, result: list[BlendMatch]) -> None:
        entry = _Entry(rid, None, BlendNamespace(""), 0.0, 0, result)
        entry.done.set()
        with self._lock:
            if rid not in self._entries and not self._closed:
                self._entries[rid] = entry
                self._stats["submitted"] += 1

    def poll(self, rid: Hashable) -> object:
        """``None``, :data:`PENDING` or the list of matches; past the budget, ``[]``."""
        try:
            with self._lock:
                entry = self._entries.get(rid)
                if entry is None:
                    return None
                expired = entry.result is PENDING and time.monotonic() >= entry.deadline
                if expired:
                    self._resolve_locked(entry, [])
                    self._stats["expired"] += 1
                result = entry.result
        except TypeError:  # an unhashable id was never submitted
            return None
        if expired:
            self._warn.warn(("budget",), "blend match for %r got no answer within its %.3g s budget; "
                            "answering no matches", rid, self._budget)
        return result

    def take(self, rid: Hashable) -> object:
        """Remove ``rid``'s entry; returns what :meth:`poll` answered just before."""
        result = self.poll(rid)
        try:
            with self._lock:
                self._entries.pop(rid, None)
        except TypeError:
            pass
        return result

    def wait(self, rid: Hashable, timeout: float | None = None) -> object:
        """Like :meth:`poll`, but first block until the entry resolves, its budget runs out or
        ``timeout`` seconds pass, whichever comes first. For callers that may block."""
        try:
            with self._lock:
                entry = self._entries.get(rid)
        except TypeError:
            return None
        if entry is None:
            return None
        remaining = max(0.0, entry.deadline - time.monotonic())
        entry.done.wait(remaining if timeout is None else min(timeout, remaining))
        return self.poll(rid)

    def stats(self) -> dict[str, int]:
        """Counters since start: submitted, short (answered without a round trip), requests
        (round trips), batch_requests, queries_sent, answered, failed, expired, discarded."""
        with self._lock:
            return dict(self._stats, pending=len(self._queue), entries=len(self._entries),
                        chunk_size=self.min_tokens)

    def alive_workers(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def close(self, join_s: float = 2.0) -> None:
        """Stop taking work; resolve queued entries to ``[]``; join the workers (bounded:
        one stuck in a round trip is a daemon thread and exits when it returns)."""
        with self._lock:
            self._closed = True
            while self._queue:
                self._resolve_locked(self._queue.popleft(), [])
            self._work.notify_all()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ workers
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                batch, expired = self._take_batch_locked(time.monotonic())
            if expired:
                self._warn.warn(("budget",), "%d blend match(es) waited past their %.3g s budget in the queue; "
                                "answering no matches", expired, self._budget)
            if batch:
                self._answer(batch)

    def _take_batch_locked(self, now: float) -> tuple[list[_Entry], int]:
        """What one round trip carries: queued live entries, oldest first, within the token and
        query budgets (a query larger than the token budget travels alone). Entries taken
        meanwhile are dropped; expired ones resolve ``[]`` here (counted, warned by caller)."""
        batch: list[_Entry] = []
        tokens = expired = 0
        limit = MAX_BATCH_QUERIES if self._coalesce else 1
        while self._queue and len(batch) < limit:
            entry = self._queue[0]
            if batch and tokens + entry.n_tokens > self._max_tokens:
                break
            self._queue.popleft()
            if self._entries.get(entry.rid) is not entry or entry.result is not PENDING:
                continue
            if now >= entry.deadline:
                self._resolve_locked(entry, [])
                self._stats["expired"] += 1
                expired += 1
                continue
            batch.append(entry)
            tokens += entry.n_tokens
        return batch, expired

    def _answer(self, batch: list[_Entry]) -> None:
        bodies: list[dict[str, Any]] = []
        sendable: list[_Entry] = []
        for entry in batch:
            try:
                bodies.append(self._wire.encode(entry.tokens, entry.namespace))
                sendable.append(entry)
            except Exception as exc:
                self._fail([entry], "encode", exc)
        if len(sendable) > 1:
            try:
                self._count(requests=1, batch_requests=1, queries_sent=len(sendable))
                self._deliver(sendable, self._wire.lookup_many(bodies))
                return
            except BatchUnsupported:
                self._coalesce = False
                self._warn.warn(("batch-unsupported",), "the blend directory has no batch lookup endpoint; "
                                "sending one request per query from now on")
            except Exception as exc:
                self._fail(sendable, "request", exc)
                return
        for entry, body in zip(sendable, bodies, strict=True):
            try:
                self._count(requests=1, queries_sent=1)
                self._deliver([entry], [self._wire.lookup_one(body)])
            except Exception as exc:
                self._fail([entry], "request", exc)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _deliver(self, entries: list[_Entry], results: list[list[BlendMatch]]) -> None:
        if len(results) != len(entries):
            raise ValueError(f"the server answered {len(results)} results for {len(entries)} queries")
        with self._lock:
            for entry, matches in zip(entries, results, strict=True):
                if self._entries.get(entry.rid) is entry and entry.result is PENDING:
                    self._resolve_locked(entry, matches)
                    self._stats["answered"] += 1
                else:
                    self._stats["discarded"] += 1

    def _fail(self, entries: list[_Entry], stage: str, exc: Exception) -> None:
        """Resolve the still-awaited ``entries`` to ``[]``; one warning for the lot (none when
        nobody awaits them any more: their expiry or take was the caller's answer)."""
        with self._lock:
            live = [e for e in entries if self._entries.get(e.rid) is e and e.result is PENDING]
            for e in live:
                self._resolve_locked(e, [])
            self._stats["failed"] += len(live)
            self._stats["discarded"] += len(entries) - len(live)
        if live:
            reason = _reason(exc)
            self._warn.warn((stage, reason), "blend match %s failed for %r%s, answering no matches: %s", stage,
                            live[0].rid, f" and {len(live) - 1} more" if len(live) > 1 else "", reason)

    @staticmethod
    def _resolve_locked(entry: _Entry, result: list[BlendMatch]) -> None:
        entry.result = result
        entry.done.set()


def _reason(exc: Exception) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
