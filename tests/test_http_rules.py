"""One HTTP rule set: the fast path answers exactly what the FastAPI routes answer.

The same corpus of good and bad requests (content types, Content-Length forms, JSON,
field types, ``tokens_b64``, sizes, the token limit; lookups, batch lookups, events,
healthz) goes through an app with the fast path and through one without it
(``create_app(fast_path=False)``), in the same order, and every answer must match in
status and body, byte for byte. The requests are raw ASGI calls, so that headers are
exactly as written here (an HTTP client would fix a bad ``Content-Length``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import pytest

from blendmatch.service.app import create_app
from blendmatch.service.http_rules import body_headers, parse_content_length
from service_support import MODEL, b64, chunks, config, events, store

pytestmark = pytest.mark.anyio

LIMIT = 4096  # max_body_bytes: small, so that "over the limit" is a small request


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def call(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"",
               *, split: bool = False) -> tuple[int, bytes]:
    """One raw ASGI request from a loopback peer; ``split``: the body in two messages."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 9300)}
    parts = [body[:len(body) // 2], body[len(body) // 2:]] if split else [body]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # no disconnect while the app answers
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def post(path: str, body: bytes, *, content_type: bytes | None = b"application/json",
         length: bytes | None = None, split: bool = False) -> tuple[str, str, list[tuple[bytes, bytes]], bytes, bool]:
    headers = [(b"host", b"test")]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    if length is None and not split:
        length = str(len(body)).encode()
    if length is not None:
        headers.append((b"content-length", length))
    return "POST", path, headers, body, split


def corpus() -> list[tuple[str, tuple[str, str, list[tuple[bytes, bytes]], bytes, bool]]]:
    rows = chunks(4)
    good_ids = json.dumps({"token_ids": rows[1].tolist() + rows[2].tolist(), "model_name": MODEL}).encode()
    good_b64 = json.dumps({"tokens_b64": b64(rows[0]), "model_name": MODEL}).encode()
    lookup = "/directory/blend-lookup"
    batch = "/directory/blend-lookup/batch"
    one = {"token_ids": rows[3].tolist(), "model_name": MODEL}
    cases: list[tuple[str, Any]] = [
        ("events: store", post("/events", json.dumps(events(store("i1", 1, rows))).encode())),
        ("events: replayed (duplicate)", post("/events", json.dumps(events(store("i1", 1, rows))).encode())),
        ("events: bad JSON", post("/events", b"{\"batches\": [")),
        ("events: empty body", post("/events", b"")),
        ("events: wrong field type", post("/events", b'{"batches": [{"instance_id": 5}]}')),
        ("events: text/plain", post("/events", b"{}", content_type=b"text/plain")),
        ("healthz", ("GET", "/healthz", [(b"host", b"test")], b"", False)),
        ("lookup: token_ids", post(lookup, good_ids)),
        ("lookup: tokens_b64", post(lookup, good_b64)),
        ("lookup: charset parameter", post(lookup, good_ids, content_type=b"Application/JSON; charset=utf-8")),
        ("lookup: no content type", post(lookup, good_ids, content_type=None)),
        ("lookup: text/plain", post(lookup, good_ids, content_type=b"text/plain")),
        ("lookup: json-ish type", post(lookup, good_ids, content_type=b"application/jsonx")),
        ("lookup: two content types", ("POST", lookup, [(b"host", b"test"), (b"content-type", b"text/plain"),
                                                        (b"content-type", b"application/json"),
                                                        (b"content-length", str(len(good_ids)).encode())],
                                       good_ids, False)),
        ("lookup: two content types, streamed", ("POST", lookup, [(b"host", b"test"),
                                                                  (b"content-type", b"application/json"),
                                                                  (b"content-type", b"text/plain")], good_ids, True)),
        ("lookup: Content-Length abc", post(lookup, good_ids, length=b"abc")),
        ("lookup: Content-Length -1", post(lookup, good_ids, length=b"-1")),
        ("lookup: Content-Length +12", post(lookup, good_ids, length=b"+12")),
        ("lookup: Content-Length huge", post(lookup, good_ids, length=b"99999999999999999999")),
        ("lookup: no Content-Length (streamed)", post(lookup, good_ids, split=True)),
        ("lookup: streamed over the limit", post(lookup, b" " * (LIMIT + 10) + good_ids, split=True)),
        ("lookup: over the limit", post(lookup, b" " * (LIMIT + 10) + good_ids)),
        ("lookup: bad JSON", post(lookup, b'{"token_ids": [1, 2')),
        ("lookup: not an object", post(lookup, b"[]")),
        ("lookup: empty body", post(lookup, b"")),
        ("lookup: model_name a number", post(lookup, b'{"token_ids": [1], "model_name": 5}')),
        ("lookup: world_size a string", post(lookup, b'{"token_ids": [1], "model_name": "m", "world_size": "1"}')),
        ("lookup: world_size 0", post(lookup, b'{"token_ids": [1], "model_name": "m", "world_size": 0}')),
        ("lookup: token id a string", post(lookup, b'{"token_ids": ["a"], "model_name": "m"}')),
        ("lookup: token id negative", post(lookup, b'{"token_ids": [-1], "model_name": "m"}')),
        ("lookup: token id over uint32", post(lookup, b'{"token_ids": [4294967296], "model_name": "m"}')),
        ("lookup: both forms", post(lookup, b'{"token_ids": [1], "tokens_b64": "AQAAAA==", "model_name": "m"}')),
        ("lookup: neither form", post(lookup, b'{"model_name": "m"}')),
        ("lookup: tokens_b64 not base64", post(lookup, b'{"tokens_b64": "!!!!", "model_name": "m"}')),
        ("lookup: tokens_b64 not whole ids", post(lookup, b'{"tokens_b64": "AQID", "model_name": "m"}')),
        ("lookup: tokens_b64 a number", post(lookup, b'{"tokens_b64": 5, "model_name": "m"}')),
        ("lookup: tokens_b64 control char", post(lookup, b'{"tokens_b64": "AQ\x01AAA==", "model_name": "m"}')),
        ("lookup: over the token limit", post(lookup, json.dumps({"tokens_b64": b64(list(range(200))),
                                                                  "model_name": MODEL}).encode())),
        ("batch: good", post(batch, json.dumps({"queries": [one, json.loads(good_b64)]}).encode())),
        ("batch: one bad tokens_b64", post(batch, json.dumps({"queries": [one, {"tokens_b64": "@@@@",
                                                                                "model_name": "m"}]}).encode())),
        ("batch: queries not a list", post(batch, b'{"queries": 5}')),
        ("batch: over the token limit", post(batch, json.dumps({"queries": [one] * 12}).encode())),
    ]
    return cases


@contextlib.asynccontextmanager
async def running(fast_path: bool) -> AsyncIterator[Any]:
    app = create_app(config(max_body_bytes=LIMIT, max_request_tokens=128), fast_path=fast_path)
    async with app.router.lifespan_context(app):
        yield app


async def test_fast_path_and_routes_answer_the_same_bytes():
    answers: dict[bool, list[tuple[int, bytes]]] = {}
    for fast in (True, False):
        async with running(fast) as app:
            answers[fast] = [await call(app, m, p, h, b, split=s) for _, (m, p, h, b, s) in corpus()]
    names = [name for name, _ in corpus()]
    diff = [(name, f, s) for name, f, s in zip(names, answers[True], answers[False]) if f != s]
    assert diff == [], diff
    by_name = dict(zip(names, answers[True]))
    # the corpus means what its names say (so that agreeing is not agreeing on nothing)
    assert by_name["events: store"][0] == 200 and json.loads(by_name["events: store"][1])["applied"] == 1
    assert json.loads(by_name["events: replayed (duplicate)"][1])["duplicates"] == 1
    assert by_name["healthz"] == (200, b'{"status":"healthy"}')
    assert json.loads(by_name["lookup: token_ids"][1])["matches"] and json.loads(by_name["lookup: tokens_b64"][1])["matches"]
    assert by_name["lookup: charset parameter"] == by_name["lookup: token_ids"]
    assert by_name["lookup: no Content-Length (streamed)"] == by_name["lookup: token_ids"]
    for name, status in [("lookup: no content type", 415), ("lookup: text/plain", 415), ("events: text/plain", 415),
                         ("lookup: json-ish type", 415), ("lookup: two content types", 400),
                         ("lookup: two content types, streamed", 400), ("lookup: Content-Length abc", 400),
                         ("lookup: Content-Length -1", 400), ("lookup: Content-Length +12", 400),
                         ("lookup: Content-Length huge", 413), ("lookup: over the limit", 413),
                         ("lookup: streamed over the limit", 413), ("lookup: bad JSON", 422),
                         ("lookup: tokens_b64 not base64", 422), ("lookup: over the token limit", 413),
                         ("batch: one bad tokens_b64", 422), ("batch: over the token limit", 413),
                         ("events: bad JSON", 422), ("events: wrong field type", 422)]:
        assert by_name[name][0] == status, (name, by_name[name])
        assert "detail" in json.loads(by_name[name][1]), name


def test_header_rules():
    assert [parse_content_length(v) for v in (b"0", b"12", b"", b"-1", b"+1", b" 1", b"1_0", b"\xd9\xa1")] == [
        0, 12, None, None, None, None, None, None]
    scope = {"headers": [(b"content-length", b"x"), (b"content-type", b"a/b"), (b"content-length", b"7")]}
    assert body_headers(scope) == (7, None, b"a/b", False)  # the last one wins
    scope["headers"] += [(b"content-type", b"application/json")]
    assert body_headers(scope) == (7, None, b"application/json", True)  # refused by body_rejection
