"""Body size limit: a pure ASGI middleware that rejects oversized bodies *before* parsing.

Two checks, because a client may send either form:

- a ``Content-Length`` over the limit is answered 413 at once, without reading the body
  (a non-numeric ``Content-Length`` is a 400);
- a chunked body (no length) is counted as it streams in; the first chunk that crosses the
  limit raises ``HTTPException(413)`` from ``receive``, which FastAPI passes through its body
  reader unchanged (any other exception there would become a generic 400).

Either way nothing is parsed, nothing is applied, and the connection stays usable.
"""

from __future__ import annotations

import json
from typing import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    """Reject HTTP request bodies larger than ``limit`` bytes with 413 (see module docstring).

    ``on_reject(status)`` is called for each rejection answered here (metrics); a streamed
    body's 413 travels as an ``HTTPException`` and is counted by its handler.
    """

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[int], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1 byte, got {limit}")
        self.app = app
        self.limit = limit
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._reply(send, 400, f"Content-Length must be an integer, got {value[:40]!r}")
                    return
                if declared > limit:
                    await self._reply(send, 413, f"request body of {declared} bytes is over the limit of {limit} bytes")
                    return
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # counted by the HTTPException handler
                    raise HTTPException(413, f"request body is over the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)

    async def _reply(self, send: Send, status: int, detail: str) -> None:
        if self._on_reject is not None:
            self._on_reject(status)
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
