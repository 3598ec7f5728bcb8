"""Body size limit: a pure ASGI middleware that rejects oversized bodies *before* parsing.

Two checks, because a client may send either form:

- a ``Content-Length`` over the limit is answered 413 at once, without reading the body
  (a non-numeric ``Content-Length`` is a 400);
- a chunked body (no length) is counted as it streams in; the first chunk that crosses the
  limit raises ``HTTPException(413)`` from ``receive``, which FastAPI passes through its body
  reader unchanged (any other exception there would become a generic 400).

Either way nothing is parsed, nothing is applied, and the connection stays usable. The
header rules themselves (what a ``Content-Length`` is, what a JSON content type is, the
error bodies) are ``http_rules.py``'s, which the fast path applies too.

Two more things about bodies are decided here, before any route sees them:

- ``json_paths``: a POST to one of these paths must say ``Content-Type: application/json``
  (parameters such as ``; charset=utf-8`` are fine); anything else, a missing type included,
  is a 415 without reading the body.
- a client that disconnects before its body is complete raises :class:`ClientDisconnected`
  from ``receive``; the handler counts it (``blendmatch_client_disconnects_total``) and logs
  one line without a traceback: it is the network's doing, not an internal error.
"""

from __future__ import annotations

from typing import Callable, Iterable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .http_rules import body_headers, body_rejection, json_body, send_json

__all__ = ["BodyLimitMiddleware", "ClientDisconnected"]


class ClientDisconnected(HTTPException):
    """The client went away before its request body was complete. An ``HTTPException`` so that
    FastAPI's body reader passes it through unchanged (any other exception there becomes a
    generic 400); the status is never seen by anyone."""

    def __init__(self, received: int) -> None:
        super().__init__(400, f"client disconnected after {received} body bytes")
        self.received = received


class BodyLimitMiddleware:
    """Reject HTTP request bodies larger than ``limit`` bytes with 413 (see module docstring).

    ``on_reject(status)`` is called for each rejection answered here (metrics); a streamed
    body's 413 travels as an ``HTTPException`` and is counted by its handler.
    """

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[int], None] | None = None,
                 json_paths: Iterable[str] = ()) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1 byte, got {limit}")
        self.app = app
        self.limit = limit
        self._on_reject = on_reject
        self.json_paths = frozenset(json_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        rejected = body_rejection(scope, body_headers(scope), limit, self.json_paths)
        if rejected is not None:
            await self._reply(send, *rejected)
            return
        received = 0
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, complete
            message = await receive()
            kind = message["type"]
            if kind == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # counted by the HTTPException handler
                    raise HTTPException(413, f"request body is over the limit of {limit} bytes")
                if not message.get("more_body", False):
                    complete = True
            elif kind == "http.disconnect" and not complete:
                raise ClientDisconnected(received)
            return message

        await self.app(scope, limited_receive, send)

    async def _reply(self, send: Send, status: int, detail: str) -> None:
        if self._on_reject is not None:
            self._on_reject(status)
        await send_json(send, status, json_body({"detail": detail}), [(b"connection", b"close")])
