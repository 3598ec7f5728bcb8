"""Clients for the blendmatch HTTP API, and the overlap resolution callers need.

``BlendClient`` (sync) and ``AsyncBlendClient`` (async) wrap ``httpx`` with keep-alive; give
them a ``base_url`` (``http://127.0.0.1:9300``) or an httpx ``transport`` (e.g.
``httpx.ASGITransport(app)`` to call an app in-process, ``httpx.MockTransport`` in tests).
Tokens travel as ``tokens_b64`` (compact; 5.3 bytes per token). ``api_key`` sends a bearer
key (a server with an access file); ``verify`` is httpx's (a CA bundle path or an
``ssl.SSLContext`` for a TLS server, docs/security.md).

Errors (``BlendClientError`` tree)::

    BlendClientError
    ├── BlendHTTPError        the server answered 4xx/5xx; .status_code, .detail
    └── BlendConnectionError  no answer (connection refused, timeout, ...)

:func:`resolve_overlaps` turns a lookup's matches (which may overlap: the server reports
every verified chunk, at most one per chunk hash) into a set a caller can scatter.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import quote

import httpx

from blendmatch.index.tokens import encode_tokens
from blendmatch.index.types import BlendMatch, BlendNamespace


__all__ = [
    "AsyncBlendClient",
    "BlendClient",
    "BlendClientError",
    "BlendConnectionError",
    "BlendHTTPError",
    "resolve_overlaps",
]

DEFAULT_URL = "http://127.0.0.1:9300"


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


def resolve_overlaps(matches: Iterable[BlendMatch], chunk_size: int = 256) -> list[BlendMatch]:
    """Non-overlapping matches, chosen greedily by ascending ``cur_st``.

    A match covers query positions ``[cur_st, cur_st + chunk_size)``. Walking matches in
    ascending ``cur_st`` (ties keep their given order, i.e. the server's: the first-indexed
    occupant wins), a match is kept iff it starts at or after the end of the last kept one.
    Because every match has the same length, this leftmost-greedy rule keeps the largest
    possible number of non-overlapping chunks (the classic interval-scheduling argument),
    and it is the rule LMCache's blend path applies. The result is in ascending ``cur_st``.
    Input order does not need to be sorted. ``chunk_size`` must be the server's.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ordered = sorted(matches, key=lambda m: m.cur_st)  # stable: ties keep their order
    out: list[BlendMatch] = []
    end = None
    for m in ordered:
        if end is None or m.cur_st >= end:
            out.append(m)
            end = m.cur_st + chunk_size
    return out


# ---------------------------------------------------------------------- shared wire code
def _query_body(tokens: Any, namespace: BlendNamespace) -> dict[str, Any]:
    return {"tokens_b64": encode_tokens(tokens), "model_name": namespace.model_name,
            "world_size": namespace.world_size, "cache_salt": namespace.cache_salt}


def _namespace(model_name: str | BlendNamespace, world_size: int, cache_salt: str) -> BlendNamespace:
    if isinstance(model_name, BlendNamespace):
        return model_name
    return BlendNamespace(model_name, cache_salt, world_size)


def _matches(payload: Mapping[str, Any]) -> list[BlendMatch]:
    return [BlendMatch(bytes.fromhex(m["chunk_hash"]), int(m["old_st"]), int(m["cur_st"]))
            for m in payload["matches"]]


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


def _queries(queries: Sequence[tuple[Any, BlendNamespace]]) -> dict[str, Any]:
    return {"queries": [_query_body(t, ns) for t, ns in queries]}


class BlendClient:
    """Synchronous client (thread-safe, keep-alive). Use as a context manager or ``close()``."""

    def __init__(self, base_url: str = DEFAULT_URL, *, transport: httpx.BaseTransport | None = None,
                 timeout: float = 30.0, api_key: str | None = None, verify: Any = True) -> None:
        self._http = httpx.Client(base_url=base_url, transport=transport, timeout=timeout,
                                  headers=_auth_headers(api_key), verify=verify)

    def __enter__(self) -> "BlendClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return _check(self._http.request(method, url, **kw))
        except httpx.TransportError as exc:
            raise BlendConnectionError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    def lookup(self, tokens: Any, model_name: str | BlendNamespace, *, world_size: int = 1,
               cache_salt: str = "") -> list[BlendMatch]:
        """Blend matches of one query (ascending ``cur_st``; may overlap)."""
        body = _query_body(tokens, _namespace(model_name, world_size, cache_salt))
        return _matches(self._request("POST", "/directory/blend-lookup", json=body).json())

    def lookup_batch(self, queries: Sequence[tuple[Any, BlendNamespace]]) -> list[list[BlendMatch]]:
        """Matches of many ``(tokens, namespace)`` queries in one request, in order."""
        payload = self._request("POST", "/directory/blend-lookup/batch", json=_queries(queries)).json()
        return [_matches(r) for r in payload["results"]]

    def post_events(self, batches: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, int]:
        """Send event batches (or a whole ``{"batches": ...}`` body); ``{applied, duplicates, stale}``."""
        return self._request("POST", "/events", json=_events_body(batches)).json()

    def fence_instance(self, instance_id: str) -> None:
        self._request("DELETE", f"/instances/{quote(instance_id, safe='')}")

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/directory/stats").json()

    def healthz(self) -> bool:
        return self._request("GET", "/healthz").json().get("status") == "healthy"


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
                     cache_salt: str = "") -> list[BlendMatch]:
        body = _query_body(tokens, _namespace(model_name, world_size, cache_salt))
        return _matches((await self._request("POST", "/directory/blend-lookup", json=body)).json())

    async def lookup_batch(self, queries: Sequence[tuple[Any, BlendNamespace]]) -> list[list[BlendMatch]]:
        payload = (await self._request("POST", "/directory/blend-lookup/batch", json=_queries(queries))).json()
        return [_matches(r) for r in payload["results"]]

    async def post_events(self, batches: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, int]:
        return (await self._request("POST", "/events", json=_events_body(batches))).json()

    async def fence_instance(self, instance_id: str) -> None:
        await self._request("DELETE", f"/instances/{quote(instance_id, safe='')}")

    async def stats(self) -> dict[str, Any]:
        return (await self._request("GET", "/directory/stats")).json()

    async def healthz(self) -> bool:
        return (await self._request("GET", "/healthz")).json().get("status") == "healthy"
