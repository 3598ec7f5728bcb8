"""The HTTP rules, each written once, for every layer that answers a request.

Question answered: "which bytes does a request with these headers and this body get, and
who decides?" Four layers answer requests, outermost first: access control
(``access.py``), the fast path (``fastpath.py``), the body-limit middleware
(``middleware.py``) and the FastAPI routes with their exception handlers (``handlers.py``).
Each of them calls this module for every rule they share, so the fast path and the
framework routes cannot drift (``tests/test_http_rules.py`` sends one corpus of good and
bad requests through the app with and without the fast path and compares status and body
byte for byte):

=====================  ==========================  =========================================
rule                   here                        applied by
=====================  ==========================  =========================================
Content-Length         :func:`parse_content_length` middleware (400, 413); fast path (hands
                       and :func:`body_rejection`   the request to the app, which answers)
JSON content type      :func:`is_json_content_type` middleware (415; 400 for a repeated
                       and :func:`body_rejection`   ``Content-Type``); fast path and lookup
                                                   lane (hand the request on)
error and JSON bodies  :func:`json_body`,           access (401/403), middleware, handlers
                       :func:`json_response`,       (every 4xx/5xx), fast path (through the
                       :func:`send_json`            handlers' functions), the HTTP limits'
                                                   refusals (``limits.py``), the operations
                                                   routes (``routes_ops.py``)
``GET /healthz``       :data:`HEALTHZ_BODY`         the route (``routes_ops.py``), fast path
reading the body       :func:`read_body`,           fast path (the app reads its own through
                       :func:`replay`               the middleware's counting ``receive``)
=====================  ==========================  =========================================

The body *parsers* are not duplicated either: a lookup body is validated by the route's own
pydantic model in both stacks (the fast path calls ``model_validate_json`` on it, with the
token arrays taken out first), and whatever the fast path cannot validate it hands to the
route, so every 4xx about a body's content is produced by the route and its handler only.
``POST /events`` bodies are decoded by ``event_source.py`` for both.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

__all__ = ["HEALTHZ_BODY", "BodyHeaders", "body_headers", "body_rejection", "is_json_content_type", "json_body",
           "json_response", "parse_content_length", "read_body", "replay", "send_json"]

#: ``GET /healthz``'s body, the same bytes from the route and from the fast path.
HEALTHZ_BODY = b'{"status":"healthy"}'

_JSON_TYPE = (b"content-type", b"application/json")


def is_json_content_type(value: bytes) -> bool:
    """``application/json``, with or without parameters, in any letter case."""
    return value.split(b";", 1)[0].strip().lower() == b"application/json"


def parse_content_length(value: bytes) -> int | None:
    """A ``Content-Length`` value: ASCII digits only (RFC 9110 8.6: ``1*DIGIT``), else None.
    Python's ``int`` would also take ``+5``, ``-1``, `` 5 `` and ``1_0``; none is a length."""
    return int(value) if value.isdigit() else None  # bytes.isdigit: ASCII digits only


class BodyHeaders(NamedTuple):
    """What a request's headers say about its body."""

    length: int | None          #: the declared length; None when absent or not a number
    bad_length: bytes | None    #: a ``Content-Length`` that is not a number, as sent
    content_type: bytes | None  #: the ``Content-Type`` value, as sent (the last one)
    repeated_type: bool = False  #: ``Content-Type`` was given more than once


def body_headers(scope: Scope) -> BodyHeaders:
    """One pass over the headers (the last ``Content-Length`` / ``Content-Type`` wins; a
    repeated ``Content-Type`` is noted, and :func:`body_rejection` refuses it: Starlette
    reads the first, so no value could be taken that every layer would agree on)."""
    length: int | None = None
    bad: bytes | None = None
    content_type: bytes | None = None
    repeated = False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            length = parse_content_length(value)
            bad = value if length is None else None
        elif name == b"content-type":
            repeated = content_type is not None
            content_type = value
    return BodyHeaders(length, bad, content_type, repeated)


def body_rejection(scope: Scope, headers: BodyHeaders, limit: int,
                   json_paths: Iterable[str] | frozenset[str]) -> tuple[int, str] | None:
    """``(status, detail)`` when the headers alone decide the answer, else None, in this
    order: a ``Content-Length`` that is not a number (400), one over ``limit`` (413), a POST
    to a JSON path with ``Content-Type`` given more than once (400: RFC 9110 allows it
    once, and layers that read the first or the last would answer one request two ways), or
    without ``Content-Type: application/json`` (415)."""
    if headers.bad_length is not None:
        return 400, f"Content-Length must be an integer, got {headers.bad_length[:40]!r}"
    if headers.length is not None and headers.length > limit:
        return 413, f"request body of {headers.length} bytes is over the limit of {limit} bytes"
    path = scope["path"]
    content_type = headers.content_type
    if scope["method"] == "POST" and path in json_paths and headers.repeated_type:
        given = [value[:60].decode("latin-1") for name, value in scope.get("headers", ()) if name == b"content-type"]
        return 400, (f"{path} takes one Content-Type header, got {len(given)}: "
                     + ", ".join(repr(v) for v in given[:4]))
    if scope["method"] == "POST" and path in json_paths and (
            content_type is None or not is_json_content_type(content_type)):
        got = "none" if content_type is None else repr(content_type[:60].decode("latin-1"))
        return 415, f"{path} takes Content-Type: application/json, got {got}"
    return None


def json_body(content: Any) -> bytes:
    """The JSON encoding of every body the service writes itself (compact, UTF-8; the same
    bytes as Starlette's ``JSONResponse``)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def json_response(content: Any, status_code: int, headers: Mapping[str, str] | None = None) -> Response:
    """A framework response with a :func:`json_body` (the exception handlers' form)."""
    return Response(json_body(content), status_code=status_code, headers=headers, media_type="application/json")


async def send_json(send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer with ready JSON bytes straight on the ASGI ``send`` (the layers outside FastAPI)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON_TYPE, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole body, and any non-body messages received while reading (a disconnect)."""
    chunks: list[bytes] = []
    tail: list[Message] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            tail.append(message)
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), tail


def replay(body: bytes, tail: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (and ``tail``) again, then the real one: a layer that
    read the body hands the request on unchanged. A tail (a disconnect) means the body
    stopped short: it is replayed as unfinished."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": bool(tail)}, *tail]

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
