"""Clients for the blendmatch HTTP API, and the overlap resolution callers need.

``BlendClient`` (sync) and ``AsyncBlendClient`` (async) wrap ``httpx`` with keep-alive; give
them a ``base_url`` (``http://127.0.0.1:9300``) or an httpx ``transport`` (e.g.
``httpx.ASGITransport(app)`` to call an app in-process, ``httpx.MockTransport`` in tests).
Tokens travel as ``tokens_b64`` (compact; 5.3 bytes per token). ``api_key`` sends a bearer
key (a server with an access file); ``verify`` is httpx's (a CA bundle path or an
``ssl.SSLContext`` for a TLS server, docs/security.md).

Two ways to ask for matches:

- ``lookup`` / ``lookup_batch`` block and raise (``BlendClientError`` tree below): for tools,
  scripts and callers that want to know why a lookup failed.
- ``submit_match`` / ``poll_match`` / ``take_match`` (and ``wait_match``) never block and never
  raise: the drop-in pattern of LMCache 0.5.6's ``BlendCoordinatorClient``, for a serving
  engine's scheduler thread. A pool of ``match_concurrency`` workers does the round trips,
  coalescing queries that wait together into one batch request; every query resolves within
  ``match_budget_s``, a failure resolving to ``[]`` with one logged warning. Rules:
  ``service/match_pool.py`` and ``docs/client.md``. ``BlendCoordinatorClient`` and ``PENDING``
  are LMCache's names for the same things, so an LMCache MP server switches with one import
  line (``from blendmatch.service.client import BlendCoordinatorClient``).

Errors of the blocking calls (``BlendClientError`` tree)::

    BlendClientError
    ├── BlendHTTPError        the server answered 4xx/5xx; .status_code, .detail
    └── BlendConnectionError  no answer (connection refused, timeout, ...)

:func:`resolve_overlaps` turns a lookup's matches (which may overlap: the server reports
at most one chunk per query position and one per chunk hash) into a set a caller can scatter.

This module imports no server module (no FastAPI, no numba): an engine process pays only for
httpx and numpy.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from typing import Any, Callable, Hashable, Iterable, Mapping, NamedTuple, Sequence
from urllib.parse import quote

import httpx
import numpy as np

from blendmatch.index.placement_rank import best_rank
from blendmatch.index.placement_rank import resolve_overlaps as _resolve
from blendmatch.index.tokens import encode_tokens
from blendmatch.index.types import BlendMatch, BlendNamespace

from .match_pool import PENDING, BatchUnsupported, MatchPool, as_namespace

__all__ = [
    "PENDING",
    "AsyncBlendClient",
    "BlendClient",
    "BlendClientError",
    "BlendConnectionError",
    "BlendCoordinatorClient",
    "BlendHTTPError",
    "MatchPlacement",
    "PlacedMatch",
    "RequestFn",
    "resolve_overlaps",
]

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:9300"

#: ``(method, path, json_body) -> json_dict``: LMCache's test hook, replacing HTTP. It must
#: raise on failure (an exception with ``status_code`` or ``response.status_code`` 404/405 on
#: the batch path means "no batch endpoint"). ``json_body`` is ``None`` for GET and DELETE.
RequestFn = Callable[[str, str, "dict[str, Any] | None"], Any]

#: LMCache ``BlendCoordinatorClient`` defaults: per-round-trip HTTP timeout and per-query
#: budget of the submit/poll path, and its worker count.
DEFAULT_REQUEST_TIMEOUT_S = 2.0
DEFAULT_MATCH_BUDGET_S = 2.0
DEFAULT_MATCH_CONCURRENCY = 8

#: LMCache's ``--coordinator-blend-timeout`` default: what ``maybe_create`` uses as both the
#: request timeout and the match budget when none is given.
LMCACHE_BLEND_TIMEOUT_S = 1.0

#: Token budget of one coalesced batch request (1 MiB of uint32, ~1.4 MB of JSON): well under
#: the server's default ``--max-request-tokens`` (10^6, summed over a batch) and its body limit.
DEFAULT_MAX_BATCH_TOKENS = 262_144

_NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BlendClientError(Exception):
    """Base of client errors."""


class BlendHTTPError(BlendClientError):
    """The server answered with an error status; ``detail`` is its reason."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class BlendConnectionError(BlendClientError):
    """The request got no answer (connection refused, reset, timed out)."""


class MatchPlacement(NamedTuple):
    """One usable copy of a matched chunk (``include_placements``); ``instance_id ""`` is a
    shared pool."""

    instance_id: str
    tier: str
    backend: str


class PlacedMatch(NamedTuple):
    """A :class:`BlendMatch`'s three fields (same positions) plus its usable copies, best
    first for the requester (the server ranks them: ``index/placement_rank.py``), and how
    many usable copies the server left out (its ``--max-placements-per-match`` and
    ``--max-placement-answer-bytes``; docs/routing.md)."""

    chunk_hash: bytes
    old_st: int
    cur_st: int
    placements: tuple[MatchPlacement, ...]
    placements_omitted: int = 0


def resolve_overlaps(matches: Iterable[Any], chunk_size: int = 256, *, prefer_placement: bool = False,
                     requester_instance_id: str | None = None) -> list[Any]:
    """Non-overlapping matches, in ascending ``cur_st``: the one rule
    (``blendmatch.index.placement_rank.resolve_overlaps``).

    Default: leftmost first (walking by ascending ``cur_st``, ties in the server's order, a
    match is kept iff it starts at or after the end of the last kept one); every match has
    the same length, so this keeps the most chunks, and it is LMCache's blend rule.
    ``prefer_placement`` (matches from a lookup with ``include_placements``, i.e.
    :class:`PlacedMatch`): of two overlapping matches the better-placed wins (its best copy
    is the requester's own L1, then another instance's L1, then a shared pool, then an
    instance's L2; ``requester_instance_id`` says whose L1 is "own"); equally placed ones
    fall back to leftmost first. It may keep fewer chunks than the default.
    ``chunk_size`` must be the server's.
    """
    if not prefer_placement:
        return _resolve(matches, chunk_size)

    def rank(m: Any) -> int:
        return best_rank([(p.instance_id, p.tier) for p in getattr(m, "placements", ())], requester_instance_id)

    return _resolve(matches, chunk_size, rank=rank)


# ---------------------------------------------------------------------- shared wire code
def _query_body(tokens: Any, namespace: BlendNamespace) -> dict[str, Any]:
    return {"tokens_b64": encode_tokens(tokens), "model_name": namespace.model_name,
            "world_size": namespace.world_size, "cache_salt": namespace.cache_salt}


def _namespace(model_name: Any, world_size: int, cache_salt: str) -> BlendNamespace:
    """A model name with the keyword arguments, or a namespace (ours or LMCache's) as it is."""
    if isinstance(model_name, str):
        return BlendNamespace(model_name, cache_salt, world_size)
    return as_namespace(model_name)


def _matches(payload: Mapping[str, Any]) -> list[BlendMatch]:
    """The matches of one answer; a malformed answer raises (KeyError, TypeError, ValueError).
    An answer with placements (``include_placements``) gives :class:`PlacedMatch` items."""
    out: list[Any] = []
    for m in payload["matches"]:
        if "placements" in m:
            out.append(PlacedMatch(bytes.fromhex(m["chunk_hash"]), int(m["old_st"]), int(m["cur_st"]),
                                   tuple(MatchPlacement(str(p["instance_id"]), str(p["tier"]), str(p["backend"]))
                                         for p in m["placements"]), int(m.get("placements_omitted", 0))))
        else:
            out.append(BlendMatch(bytes.fromhex(m["chunk_hash"]), int(m["old_st"]), int(m["cur_st"])))
    return out


def _placement_options(body: dict[str, Any], include_placements: bool, requester_instance_id: str | None
                       ) -> dict[str, Any]:
    """``body`` with the opt-in placement fields (absent by default: LMCache's body as is)."""
    if include_placements:
        body["include_placements"] = True
        if requester_instance_id is not None:
            body["requester_instance_id"] = requester_instance_id
    return body


def _score_body(tokens: Any, namespace: BlendNamespace, candidates: Sequence[str] | None) -> dict[str, Any]:
    body = _query_body(tokens, namespace)
    if candidates is not None:
        body["candidates"] = list(candidates)
    return body


def _results(payload: Mapping[str, Any]) -> list[list[BlendMatch]]:
    return [_matches(r) for r in payload["results"]]


def _events_body(batches: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> Mapping[str, Any]:
    return batches if isinstance(batches, Mapping) else {"batches": list(batches)}


def _auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` for a server with an access file (docs/security.md)."""
    return {} if api_key is None else {"authorization": f"Bearer {api_key}"}


def _check(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        try:
            detail = str(response.json().get("detail", response.text))
        except ValueError:
            detail = response.text[:500]
        raise BlendHTTPError(response.status_code, detail)
    return response


def _queries(queries: Sequence[tuple[Any, BlendNamespace]], include_placements: bool = False,
             requester_instance_id: str | None = None) -> dict[str, Any]:
    return {"queries": [_placement_options(_query_body(t, as_namespace(ns)), include_placements, requester_instance_id)
                        for t, ns in queries]}


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries: ours, httpx's ``HTTPStatusError``, or a test hook's."""
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


class _ClientWire:
    """The :class:`~blendmatch.service.match_pool.MatchWire` of a :class:`BlendClient`."""

    def __init__(self, client: "BlendClient") -> None:
        self._client = client

    def encode(self, tokens: Any, namespace: BlendNamespace) -> dict[str, Any]:
        return _query_body(tokens, namespace)

    def lookup_one(self, body: dict[str, Any]) -> list[BlendMatch]:
        return _matches(self._client._match_call("/directory/blend-lookup", body))

    def lookup_many(self, bodies: Sequence[dict[str, Any]]) -> list[list[BlendMatch]]:
        try:
            payload = self._client._match_call("/directory/blend-lookup/batch", {"queries": list(bodies)})
        except Exception as exc:
            if _status_of(exc) in (404, 405):  # LMCache's coordinator: no batch endpoint
                raise BatchUnsupported(str(exc)) from exc
            raise
        return _results(payload)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def _default_transport(match_concurrency: int) -> httpx.HTTPTransport:
    """Keep-alive for every worker plus the blocking callers, and TCP_NODELAY: a request's
    headers and body may leave in two writes, and with Nagle on the second waits for the
    server's delayed ACK (~40 ms per round trip on Linux)."""
    limits = httpx.Limits(max_connections=max(100, 2 * match_concurrency),
                          max_keepalive_connections=max(20, match_concurrency + 4))
    return httpx.HTTPTransport(limits=limits, socket_options=[_NODELAY])


class BlendClient:
    """Synchronous client (thread-safe, keep-alive). Use as a context manager or ``close()``.

    Blocking calls (``lookup``, ``lookup_batch``, ``post_events``, ...) use ``timeout`` and
    raise :class:`BlendClientError`. The drop-in match calls (``submit_match`` ...) use
    ``request_timeout`` per round trip and ``match_budget_s`` per query, and never raise; their
    worker pool starts on the first submit (or :meth:`start`; :meth:`maybe_create` returns a
    started client). ``request_fn`` replaces HTTP for every call (LMCache's test hook).
    The keyword names after ``timeout`` are LMCache's ``BlendCoordinatorClient``'s.

    Raises ``ValueError`` for ``match_concurrency < 1`` and for non-positive timeouts, budgets
    or sizes: those are configuration bugs, found at start-up rather than on the first request.
    """

    def __init__(self, base_url: str = DEFAULT_URL, *, transport: httpx.BaseTransport | None = None,
                 timeout: float = 30.0, api_key: str | None = None, verify: Any = True,
                 request_fn: RequestFn | None = None,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
                 match_budget_s: float = DEFAULT_MATCH_BUDGET_S,
                 match_concurrency: int = DEFAULT_MATCH_CONCURRENCY, chunk_size: int | None = None,
                 coalesce: bool | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        if match_concurrency < 1:
            raise ValueError(f"match_concurrency must be >= 1, got {match_concurrency}")
        _check_positive(timeout=timeout, request_timeout=request_timeout, match_budget_s=match_budget_s,
                        max_batch_tokens=max_batch_tokens, chunk_size=1 if chunk_size is None else chunk_size)
        #: Per-query wall-clock budget of the submit/poll path, queue wait included (LMCache's
        #: blend module reads this attribute to set its own poll deadline).
        self.match_budget_s = float(match_budget_s)
        self.request_timeout = float(request_timeout)
        self.match_concurrency = int(match_concurrency)
        #: The fleet's chunk size: shorter queries are answered ``[]`` without a round trip.
        #: ``None``: learn it from the server's ``GET /directory/stats`` when the workers start
        #: (over the client's own HTTP connection only: a ``request_fn`` sees LMCache's calls
        #: and nothing else, so with one the size stays unknown), and send every non-empty
        #: query until then (a wrong guess would lose matches: LMCache calls ``maybe_create``
        #: without a chunk size); the server answers a short query ``[]``.
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        #: Queries that wait together travel as one batch request. Default: on over HTTP, off
        #: with a ``request_fn`` (LMCache's hook sees only LMCache's one call per query).
        self.coalesce = (request_fn is None) if coalesce is None else bool(coalesce)
        self.max_batch_tokens = int(max_batch_tokens)
        self._request_fn = request_fn
        self._http = None if request_fn is not None else httpx.Client(
            base_url=base_url.rstrip("/"), transport=transport or _default_transport(match_concurrency),
            timeout=timeout, headers=_auth_headers(api_key), verify=verify)
        self._pool: MatchPool | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    @classmethod
    def maybe_create(cls, url: str | None, *, timeout: float = LMCACHE_BLEND_TIMEOUT_S,
                     match_concurrency: int = DEFAULT_MATCH_CONCURRENCY, **options: Any) -> "BlendClient | None":
        """A started client for ``url``, or ``None`` when ``url`` is ``None``, empty or blank.

        LMCache's factory (its MP server calls it with ``--coordinator-blend-timeout`` and
        ``--coordinator-blend-match-concurrency``): ``timeout`` is both the per-round-trip
        timeout and the per-query match budget. ``options`` go to the constructor
        (``chunk_size``, ``coalesce``, ``max_batch_tokens``, ``transport``, ``request_fn``).
        Raises ``ValueError`` for ``match_concurrency < 1``.
        """
        url = (url or "").strip()
        if not url:
            return None
        client = cls(url, timeout=timeout, request_timeout=timeout, match_budget_s=timeout,
                     match_concurrency=match_concurrency, **options)
        client.start()
        logger.info("blend match client enabled -> %s (budget %.3g s, %d workers, coalescing %s)", url,
                    client.match_budget_s, client.match_concurrency, "on" if client.coalesce else "off")
        return client

    def __enter__(self) -> "BlendClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the match workers (queued queries resolve ``[]``) and close the connections.
        Idempotent. Later submits are ignored (their ids poll ``None``)."""
        with self._pool_lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.close()
        if self._http is not None:
            self._http.close()

    # ------------------------------------------------------------------ transport
    def _call(self, method: str, path: str, payload: Any = None, timeout: float | None = None) -> Any:
        """One request's JSON answer (``{}`` for an empty body); raises BlendClientError, or
        whatever ``request_fn`` raises."""
        if self._request_fn is not None:
            return self._request_fn(method, path, payload)
        assert self._http is not None
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            response = _check(self._http.request(method, path, json=payload, **kw))
        except httpx.TransportError as exc:
            raise BlendConnectionError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        return response.json() if response.content else {}

    def _match_call(self, path: str, payload: dict[str, Any]) -> Any:
        return self._call("POST", path, payload, timeout=self.request_timeout)

    # ------------------------------------------------------------------ blocking calls
    def lookup(self, tokens: Any, model_name: str | BlendNamespace, *, world_size: int = 1,
               cache_salt: str = "", include_placements: bool = False,
               requester_instance_id: str | None = None) -> list[BlendMatch]:
        """Blend matches of one query (ascending ``cur_st``; may overlap). With
        ``include_placements``: :class:`PlacedMatch` items, each with its usable copies ranked
        for ``requester_instance_id`` (matches no live instance holds are left out)."""
        body = _placement_options(_query_body(tokens, _namespace(model_name, world_size, cache_salt)),
                                  include_placements, requester_instance_id)
        return _matches(self._call("POST", "/directory/blend-lookup", body))

    def route_score(self, tokens: Any, model_name: str | BlendNamespace, *, world_size: int = 1,
                    cache_salt: str = "", candidates: Sequence[str] | None = None) -> dict[str, Any]:
        """``POST /route/score``: per instance, the request's tokens it could serve from its L1
        (prefix and fragments), and the tokens any instance could fetch from a shared pool
        (docs/routing.md)."""
        body = _score_body(tokens, _namespace(model_name, world_size, cache_salt), candidates)
        return self._call("POST", "/route/score", body)  # type: ignore[no-any-return]

    def lookup_batch(self, queries: Sequence[tuple[Any, BlendNamespace]], *, include_placements: bool = False,
                     requester_instance_id: str | None = None) -> list[list[BlendMatch]]:
        """Matches of many ``(tokens, namespace)`` queries in one request, in order (with
        ``include_placements``, as :meth:`lookup`'s, for every query)."""
        body = _queries(queries, include_placements, requester_instance_id)
        return _results(self._call("POST", "/directory/blend-lookup/batch", body))

    def post_events(self, batches: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, int]:
        """Send event batches (or a whole ``{"batches": ...}`` body); ``{applied, duplicates, stale}``."""
        return self._call("POST", "/events", _events_body(batches))

    def deregister_instance(self, instance_id: str) -> None:
        """``DELETE /instances/{id}``: the instance left (its registration, event cursor and
        declared capacity are dropped and its private L1 placements fenced)."""
        self._call("DELETE", f"/instances/{quote(instance_id, safe='')}")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/directory/stats")

    def healthz(self) -> bool:
        return self._call("GET", "/healthz").get("status") == "healthy"

    # ------------------------------------------------------------------ drop-in match calls
    def start(self) -> "BlendClient":
        """Start the ``match_concurrency`` match workers (idempotent; no-op after close)."""
        self._ensure_pool()
        return self

    def _ensure_pool(self) -> MatchPool | None:
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                if self._pool is None and not self._closed:
                    self._pool = MatchPool(_ClientWire(self), workers=self.match_concurrency,
                                           budget_s=self.match_budget_s, chunk_size=self.chunk_size or 1,
                                           coalesce=self.coalesce, max_batch_tokens=self.max_batch_tokens)
                    if self.chunk_size is None and self._http is not None:
                        threading.Thread(target=self._learn_chunk_size, args=(self._pool,),
                                         name="blendmatch-chunk-size", daemon=True).start()
                pool = self._pool
        return None if self._closed else pool

    def _learn_chunk_size(self, pool: MatchPool) -> None:
        """Ask the server its chunk size once (``blendmatch.chunk_size`` of ``/directory/stats``);
        on any failure keep sending every non-empty query (correct, only less frugal)."""
        try:
            size = self._call("GET", "/directory/stats", timeout=self.request_timeout)["blendmatch"]["chunk_size"]
        except Exception as exc:
            logger.info("blend match client: the server's chunk size is unknown (%s: %s); every non-empty "
                        "query is sent", type(exc).__name__, exc)
            return
        if isinstance(size, int) and size > 0:
            self.chunk_size = pool.min_tokens = size

    def submit_match(self, request_id: Hashable, tokens: Sequence[int] | np.ndarray, namespace: Any) -> None:
        """Queue a match query for ``request_id``; returns at once; idempotent per id.

        ``tokens``: the request's token ids (list or array; the caller must not mutate it
        until the entry resolves). ``namespace``: a ``BlendNamespace`` (ours or LMCache's:
        anything with ``model_name``, ``cache_salt``, ``world_size``) or a model name.
        A query shorter than ``chunk_size`` resolves ``[]`` at once. Never raises.
        """
        try:
            pool = self._ensure_pool()
        except Exception as exc:  # e.g. the interpreter cannot start threads (shutting down)
            logger.warning("blend match workers did not start: %s: %s", type(exc).__name__, exc)
            return
        if pool is not None:
            pool.submit(request_id, tokens, namespace)

    def poll_match(self, request_id: Hashable) -> "list[BlendMatch] | object | None":
        """``None`` (unknown or taken id), :data:`PENDING` (in flight) or the matches
        (``chunk_hash`` bytes, ascending ``cur_st``; ``[]`` for a miss or a failure). Past the
        budget an unanswered query polls ``[]``."""
        pool = self._pool
        return None if pool is None else pool.poll(request_id)

    def take_match(self, request_id: Hashable) -> "list[BlendMatch] | object | None":
        """Remove ``request_id``'s entry and return what :meth:`poll_match` answered just
        before. A late answer for a taken id is discarded. (LMCache's returns ``None``.)"""
        pool = self._pool
        return None if pool is None else pool.take(request_id)

    def wait_match(self, request_id: Hashable, timeout: float | None = None) -> "list[BlendMatch] | object | None":
        """:meth:`poll_match` after blocking until the answer, the budget or ``timeout``
        (seconds), whichever comes first. Ours: for callers that may block."""
        pool = self._pool
        return None if pool is None else pool.wait(request_id, timeout)

    def match_stats(self) -> dict[str, int]:
        """Counters of the match path (see ``MatchPool.stats``), plus ``workers`` alive."""
        pool = self._pool
        if pool is None:
            return {"workers": 0}
        return dict(pool.stats(), workers=pool.alive_workers())


#: LMCache 0.5.6's name for :class:`BlendClient` (``lmcache.v1.mp_coordinator.blend_client``):
#: same constructor keywords, ``maybe_create``, ``submit_match/poll_match/take_match``, ``close``.
BlendCoordinatorClient = BlendClient


class AsyncBlendClient:
    """Asynchronous client (keep-alive). ``async with AsyncBlendClient(...) as c: ...``."""

    def __init__(self, base_url: str = DEFAULT_URL, *, transport: httpx.AsyncBaseTransport | None = None,
                 timeout: float = 30.0, limits: httpx.Limits | None = None, api_key: str | None = None,
                 verify: Any = True) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout,
                                       headers=_auth_headers(api_key), verify=verify,
                                       limits=limits or httpx.Limits(max_connections=100,
                                                                     max_keepalive_connections=100))

    async def __aenter__(self) -> "AsyncBlendClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return _check(await self._http.request(method, url, **kw))
        except httpx.TransportError as exc:
            raise BlendConnectionError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    async def lookup(self, tokens: Any, model_name: str | BlendNamespace, *, world_size: int = 1,
                     cache_salt: str = "", include_placements: bool = False,
                     requester_instance_id: str | None = None) -> list[BlendMatch]:
        body = _placement_options(_query_body(tokens, _namespace(model_name, world_size, cache_salt)),
                                  include_placements, requester_instance_id)
        return _matches((await self._request("POST", "/directory/blend-lookup", json=body)).json())

    async def route_score(self, tokens: Any, model_name: str | BlendNamespace, *, world_size: int = 1,
                          cache_salt: str = "", candidates: Sequence[str] | None = None) -> dict[str, Any]:
        body = _score_body(tokens, _namespace(model_name, world_size, cache_salt), candidates)
        return (await self._request("POST", "/route/score", json=body)).json()  # type: ignore[no-any-return]

    async def lookup_batch(self, queries: Sequence[tuple[Any, BlendNamespace]], *, include_placements: bool = False,
                           requester_instance_id: str | None = None) -> list[list[BlendMatch]]:
        body = _queries(queries, include_placements, requester_instance_id)
        payload = (await self._request("POST", "/directory/blend-lookup/batch", json=body)).json()
        return [_matches(r) for r in payload["results"]]

    async def post_events(self, batches: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, int]:
        return (await self._request("POST", "/events", json=_events_body(batches))).json()

    async def deregister_instance(self, instance_id: str) -> None:
        """``DELETE /instances/{id}`` (see :meth:`BlendClient.deregister_instance`)."""
        await self._request("DELETE", f"/instances/{quote(instance_id, safe='')}")

    async def stats(self) -> dict[str, Any]:
        return (await self._request("GET", "/directory/stats")).json()

    async def healthz(self) -> bool:
        return (await self._request("GET", "/healthz")).json().get("status") == "healthy"
