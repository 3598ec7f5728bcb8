"""The lookup lane (service/lane.py) over real loopback sockets: the app under uvicorn with
the protocol ``blendmatch serve`` gives it (``proxy_headers`` off, as the CLI runs it).

Every answer the lane gives is compared byte for byte (the ``date`` header's value aside)
with the answer of the usual path to the same request: the same lookup sent to
``/directory/blend-lookup?via=app``, which the lane does not take (a query string) and the
route reads the same. Counters on the lane's entry points say the lane really answered.
"""

from __future__ import annotations

import gc
import logging
import json
import re
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blendmatch.service import limits as limits_mod
from blendmatch.service.access import hash_key

from service_support import C, MODEL, b64, chunks, events, hash_of, metric_samples, store
from test_http_limits import Served as _Served

LANE = b"/directory/blend-lookup"
APP = b"/directory/blend-lookup?via=app"


class Served(_Served):
    """The app under uvicorn as ``blendmatch serve`` runs it (the lane's settings)."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(cli_uvicorn=True, **overrides)


def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


_PENDING: "weakref.WeakKeyDictionary[socket.socket, bytes]" = weakref.WeakKeyDictionary()  # bytes past a response


def read_response(s: socket.socket) -> bytes:
    """The next final response (head + Content-Length body) from ``s``; an interim ``100
    Continue`` is skipped, and bytes past the response (a pipelined one) are kept for the
    next call."""
    data = _PENDING.pop(s, b"")
    while True:
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            assert got, f"connection closed mid-head: {data!r}"
            data += got
        head, _, rest = data.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 100 "):
            data = rest
            continue
        n = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(rest) < n:
            got = s.recv(65536)
            assert got, "connection closed mid-body"
            rest += got
        if len(rest) > n:
            _PENDING[s] = rest[n:]
        return head + b"\r\n\r\n" + rest[:n]


def undated(response: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*", b"\r\ndate: -", response)


def ask(srv: Served, path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    with srv.connect() as s:
        s.sendall(post(path, body, extra))
        return read_response(s)


@pytest.fixture
def lane_calls(monkeypatch) -> dict[str, int]:
    """How many requests the lane took (``start`` said yes) and finished."""
    calls = {"taken": 0, "finished": 0}
    start, finish = limits_mod.lane_start, limits_mod.lane_finish

    def counted_start(proto, lane):
        taken = start(proto, lane)
        calls["taken"] += taken
        return taken

    def counted_finish(proto, lane, cycle):
        calls["finished"] += 1
        return finish(proto, lane, cycle)

    monkeypatch.setattr(limits_mod, "lane_start", counted_start)
    monkeypatch.setattr(limits_mod, "lane_finish", counted_finish)
    return calls


def fill(srv: Served, rows: np.ndarray) -> None:
    body = json.dumps(events(store("inst-a", 1, rows))).encode()
    with srv.connect() as s:
        s.sendall(post(b"/events", body))
        assert read_response(s).startswith(b"HTTP/1.1 200 ")


def lookup(tokens: np.ndarray, **fields: Any) -> bytes:
    return json.dumps({"tokens_b64": b64(tokens), "model_name": MODEL, **fields}).encode()


def test_lane_answers_exactly_as_the_app(lane_calls):
    rows = chunks(8, seed=3)
    with Served() as srv:
        fill(srv, rows)
        other = np.random.default_rng(9).integers(60_000, 90_000, size=40, dtype=np.uint32)
        bodies = [lookup(np.concatenate([other[:5], rows[2], other[5:9], rows[6], other[9:]])),  # two matches
                  lookup(other),  # none
                  lookup(rows[1], cache_salt="another tenant"),  # another namespace: none
                  json.dumps({"model_name": MODEL, "token_ids": rows[4].tolist()}).encode(),  # the ids form
                  # over uvicorn's 64 KiB read pause: the lane resumes reading itself
                  lookup(np.concatenate([np.random.default_rng(2).integers(60_000, 90_000, 20_000, dtype=np.uint32),
                                         rows[7]]))]
        for body in bodies:
            via_lane = ask(srv, LANE, body)
            assert via_lane.startswith(b"HTTP/1.1 200 OK\r\n")
            assert undated(via_lane) == undated(ask(srv, APP, body))
        assert b'"matches":[{' in ask(srv, LANE, bodies[0])
    assert lane_calls["taken"] == lane_calls["finished"] == len(bodies) + 1


@pytest.mark.parametrize("body, status", [
    (json.dumps({"tokens_b64": "@@@@", "model_name": MODEL}).encode(), 422),  # does not decode (lookup thread)
    (json.dumps({"tokens_b64": b64(np.arange(64)), "model_name": MODEL}).encode(), 413),  # over the token limit
    (json.dumps({"tokens_b64": b64(np.arange(8))}).encode(), 422),  # no model_name
    (b'{"tokens_b64": ', 422),  # not JSON
    (json.dumps({"tokens_b64": b64(np.arange(8)), "model_name": MODEL, "include_placements": True}).encode(), 200),
])
def test_what_the_lane_does_not_answer_the_app_answers(lane_calls, body, status):
    with Served(max_request_tokens=32) as srv:
        via_lane = ask(srv, LANE, body)
        assert via_lane.startswith(b"HTTP/1.1 %d " % status), via_lane[:200]
        assert undated(via_lane) == undated(ask(srv, APP, body))
    assert lane_calls["taken"] == lane_calls["finished"] == 1


def test_bytes_outside_ascii_answer_as_the_app(lane_calls):
    """The lane leaves the string's ASCII test to the decoder: a byte outside ASCII inside
    ``tokens_b64`` is refused there (and the app answers), one outside the string is the
    model's to judge, as in the app."""
    rows = chunks(2, seed=11)
    good = b64(rows[0])
    bodies = [('{"tokens_b64": "%s\u00e9%s", "model_name": "%s"}' % (good[:8], good[8:], MODEL)).encode(),
              ('{"tokens_b64": "%s\u00e9", "model_name": "%s"}' % (good[:-4], MODEL)).encode(),
              ('{"tokens_b64": "%s", "model_name": "mod\u00e8le"}' % good).encode(),
              ('{"tokens_b64": "%s", "model_name": "%s", "cache_salt": "s\u00e9l"}' % (good, MODEL)).encode()]
    with Served() as srv:
        fill(srv, rows)
        for body in bodies:
            body = body.decode("unicode_escape").encode("utf-8")
            assert not body.isascii()
            via_lane = ask(srv, LANE, body)
            assert undated(via_lane) == undated(ask(srv, APP, body)), via_lane[:300]
    assert lane_calls["taken"] == len(bodies)


def test_requests_the_lane_leaves_alone(lane_calls):
    body = lookup(np.arange(20, dtype=np.uint32))
    with Served() as srv:
        for request in (post(APP, body),  # a query string
                        post(LANE, body, b"Expect: 100-continue\r\n"),
                        post(LANE, body).replace(b"Content-Type: application/json", b"Content-Type: text/plain"),
                        post(LANE, body).replace(b"HTTP/1.1", b"HTTP/1.0", 1)):
            with srv.connect() as s:
                s.sendall(request)
                head = read_response(s)  # an interim 100 Continue first for the Expect one
                assert head.startswith(b"HTTP/1.1 200 " if b"text/plain" not in request else b"HTTP/1.1 415 ")
    assert lane_calls["taken"] == 0


def test_pipelined_split_and_kept_alive(lane_calls):
    rows = chunks(4, seed=5)
    with Served() as srv:
        fill(srv, rows)
        a, b = lookup(rows[0]), lookup(rows[3])
        expect_a, expect_b = undated(ask(srv, APP, a)), undated(ask(srv, APP, b))
        with srv.connect() as s:
            s.sendall(post(LANE, a) + post(LANE, b))  # pipelined: answered in order
            assert undated(read_response(s)) == expect_a
            assert undated(read_response(s)) == expect_b
            raw = post(LANE, b)
            for piece in (raw[:10], raw[10:70], raw[70:-5], raw[-5:]):  # a request in pieces
                s.sendall(piece)
                time.sleep(0.05)
            assert undated(read_response(s)) == expect_b
            big = lookup(np.concatenate([np.arange(25_000, dtype=np.uint32) + 60_000, rows[1]]))
            raw = post(LANE, big)  # over 64 KiB, in two reads: uvicorn pauses reading after the first
            s.sendall(raw[:70_000])
            time.sleep(0.1)
            s.sendall(raw[70_000:])
            assert b'"ab0000000000000001"' in read_response(s)
            s.sendall(post(LANE, a, b"Connection: close\r\n"))
            last = read_response(s)
            assert b"\r\nconnection: close\r\n" in last
            assert s.recv(100) == b""  # closed after the answer
    assert lane_calls["taken"] >= 4  # the first of the pipelined pair, the pieces, the big one, the last


def test_the_lane_asks_access_control(tmp_path: Path, lane_calls):
    key = "reader-secret-key-0123456789"
    access = tmp_path / "access.toml"
    access.write_text(f'[[key]]\nname = "reader"\nsha256 = "{hash_key(key)}"\nroles = ["reader"]\n')
    body = lookup(np.arange(20, dtype=np.uint32))
    with Served(access_file=str(access)) as srv:
        granted = ask(srv, LANE, body, b"Authorization: Bearer %s\r\n" % key.encode())
        assert granted.startswith(b"HTTP/1.1 200 ")
        assert lane_calls["taken"] == 1
        for extra in (b"", b"Authorization: Bearer wrong\r\n"):  # refused the usual way, by the usual words
            refused = ask(srv, LANE, body, extra)
            assert refused.startswith(b"HTTP/1.1 401 " if extra else b"HTTP/1.1 403 ")
            assert undated(refused) == undated(ask(srv, APP, body, extra))
        assert lane_calls["taken"] == 1


def test_a_client_gone_before_its_answer(lane_calls):
    """The answer of a client that closed first is dropped; the server serves on."""
    body = lookup(np.arange(4000, dtype=np.uint32))
    with Served() as srv:
        for _ in range(5):
            s = srv.connect()
            s.sendall(post(LANE, body))
            s.close()
        assert ask(srv, LANE, body).startswith(b"HTTP/1.1 200 ")
    assert lane_calls["taken"] == 6


def test_a_graceful_stop_answers_the_lookup_in_flight(lane_calls, monkeypatch):
    """uvicorn's graceful stop sees the lane's request in progress: the lookup is answered,
    with ``connection: close``, and then the connection closes (nothing cut short)."""
    from blendmatch.service.context import ServiceContext

    started = threading.Event()
    run = ServiceContext._run_lookups

    def slow(self, queries):
        started.set()
        time.sleep(0.5)
        return run(self, queries)

    monkeypatch.setattr(ServiceContext, "_run_lookups", slow)
    body = lookup(np.arange(20, dtype=np.uint32))
    with Served() as srv:
        s = srv.connect()
        s.sendall(post(LANE, body))
        assert started.wait(5)
        srv.server.should_exit = True  # what SIGTERM does
        answer = read_response(s)
        assert answer.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close\r\n" in answer
        assert s.recv(100) == b""
        s.close()
    assert lane_calls["finished"] == 1


def test_lane_requests_leave_no_reference_cycles(lane_calls):
    """Each request's cycle used to hold a closure over itself (limits.py): garbage only the
    collector could free, whose passes cost the loop ~6% under load."""
    body = lookup(np.arange(20, dtype=np.uint32))
    with Served() as srv, srv.connect() as s:
        s.sendall(post(LANE, body))
        read_response(s)
        gc.collect()
        gc.disable()
        try:
            for _ in range(40):
                s.sendall(post(LANE, body))
                read_response(s)
                s.sendall(post(APP, body))  # the ordinary cycle too
                read_response(s)
            found = gc.collect()
        finally:
            gc.enable()
    assert lane_calls["finished"] >= 41
    assert found < 40, f"{found} unreachable objects after 80 requests: a reference cycle per request"


def test_the_lane_keeps_the_lookup_latency_metric(lane_calls):
    body = lookup(np.arange(20, dtype=np.uint32))
    with Served() as srv:
        before = _single_lookups(srv)
        for _ in range(3):
            ask(srv, LANE, body)
        assert _single_lookups(srv) == before + 3
    assert lane_calls["finished"] == 3


def _single_lookups(srv: Served) -> float:
    with srv.connect() as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        text = read_response(s).partition(b"\r\n\r\n")[2].decode()
    return metric_samples(text)['blendmatch_lookup_latency_seconds_count{endpoint="single"}']


def test_the_lane_parses_on_the_lookup_thread(lane_calls, monkeypatch):
    """The event loop queues the raw body; the lookup thread parses it with its batch (the
    loop's share of a lookup is the stage that sets the rate: docs/performance.md)."""
    from blendmatch.service import lane as lane_mod

    threads: list[str] = []
    parse = lane_mod.parse_body

    def watched(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return parse(*args, **kw)

    monkeypatch.setattr(lane_mod, "parse_body", watched)
    rows = chunks(2, seed=5)
    with Served() as srv:
        fill(srv, rows)
        for body in (lookup(rows[0]), json.dumps({"model_name": MODEL, "token_ids": rows[1].tolist()}).encode()):
            assert b'"matches":[{' in ask(srv, LANE, body)
    assert lane_calls["finished"] == 2
    assert len(threads) == 2 and all(name.startswith("blendmatch-lookup") for name in threads), threads


@pytest.mark.parametrize("tokens", [0, 1, 7, 8_192, 70_000])
def test_the_lanes_cost_bounds_the_tokens_of_either_form(tokens):
    """The batcher's cost of a body not parsed yet is never below the tokens it carries."""
    from blendmatch.service.lane import _most_tokens

    ids = np.zeros(tokens, dtype=np.uint32)  # the shortest ids: one digit each
    for body in (lookup(ids), lookup(ids, cache_salt="s" * 300),
                 json.dumps({"model_name": MODEL, "token_ids": ids.tolist()}, separators=(",", ":")).encode()):
        assert _most_tokens(body) >= tokens


def test_a_batch_answers_each_deferred_query_on_its_own():
    """One body the lookup thread cannot parse fails that query alone; its neighbours in the
    batch (deferred, plain, one that does not decode) get their own answers."""
    from blendmatch.index.tokens import TokenDecodeError
    from blendmatch.index.wire import parse_event_body
    from blendmatch.service.config import ServiceConfig
    from blendmatch.service.context import DeferredQuery, ServiceContext
    from blendmatch.service.lane import _query

    ctx = ServiceContext(ServiceConfig(chunk_size=C, engine="cpu"))
    rows = chunks(3, seed=4)
    ctx.directory.apply_many([parse_event_body(json.dumps(events(store("inst-a", 1, rows))).encode())])

    def deferred(body: bytes) -> tuple[Any, None]:
        return DeferredQuery(lambda: _query(ctx, body), 1 << 20), None

    good = deferred(lookup(rows[1]))
    bad = deferred(b'{"tokens_b64": ')
    plain = (b64(rows[2]).encode(), _query(ctx, lookup(rows[2]))[1])
    undecodable = deferred(json.dumps({"tokens_b64": "@@@@", "model_name": MODEL}).encode())
    out = ctx._run_lookups([good, bad, plain, undecodable, deferred(lookup(rows[0]))])
    # each answer is its own row's chunk: the hash and offset it was stored with, at 0
    assert [json.loads(out[k])["matches"] for k in (0, 2, 4)] == [
        [{"chunk_hash": hash_of(i).hex(), "old_st": i * C, "cur_st": 0}] for i in (1, 2, 0)]
    assert isinstance(out[1], ValueError)
    assert isinstance(out[3], TokenDecodeError)


def test_abandoned_lookups_log_one_line_and_no_traceback(lane_calls, monkeypatch, caplog):
    """100 lane lookups that fail on the lookup thread (a ``tokens_b64`` that does not decode,
    ``include_placements``) whose clients are gone before the answer: each future's exception
    is retrieved (asyncio logged "Future exception was never retrieved" with a traceback for
    every one, at ERROR, when the future was freed), and the disconnects are one line in all
    (rate-limited), never a traceback."""
    from blendmatch.service import lane as lane_mod
    from blendmatch.service.context import ServiceContext

    gate = threading.Event()
    run = ServiceContext._run_lookups

    def held(self, queries):
        gate.wait(20)  # answers only once every client is gone
        return run(self, queries)

    answered = {"n": 0}
    real_answered = lane_mod._answered

    def counted(*args: Any) -> None:
        answered["n"] += 1
        real_answered(*args)

    monkeypatch.setattr(ServiceContext, "_run_lookups", held)
    monkeypatch.setattr(lane_mod, "_answered", counted)
    bodies = [json.dumps({"tokens_b64": "@@@@", "model_name": MODEL}).encode(),
              lookup(np.arange(20, dtype=np.uint32), include_placements=True)]
    caplog.set_level(logging.INFO)
    with Served() as srv:
        for i in range(100):
            with srv.connect() as s:
                s.sendall(post(LANE, bodies[i % 2]))
        srv.wait_until("every client gone", lambda: lane_calls["finished"] == 100 and not srv.limits.open)
        gate.set()
        srv.wait_until("every lookup done", lambda: answered["n"] == 100, timeout=20)
        gc.collect()  # a future whose exception nobody retrieved logs it when it is freed
        assert ask(srv, LANE, lookup(np.arange(20, dtype=np.uint32))).startswith(b"HTTP/1.1 200 ")
        gc.collect()
    never = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert never == [], f"{len(never)} x {never[0].getMessage()[:200]}"
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    gone = [r for r in caplog.records if "before its answer" in r.getMessage()]
    assert len(gone) == 1, [r.getMessage() for r in caplog.records]
    assert gone[0].levelno == logging.INFO and gone[0].name == "blendmatch.service.limits"


@pytest.mark.parametrize("types", [(b"text/plain", b"application/json"), (b"application/json", b"text/plain"),
                                   (b"application/json", b"application/json")])
def test_two_content_types_get_one_answer_on_every_path(lane_calls, types):
    """A lookup with ``Content-Type`` given twice is refused alike (400) whichever path it
    takes: the lane's entry, the fast path (a query string), the routes (a chunked body, or
    the fast path off). The lane and the fast path took the last value and the framework the
    first, so one request got 200 or 415 by its framing."""
    body = lookup(np.arange(20, dtype=np.uint32))
    head = b"".join(b"Content-Type: %s\r\n" % t for t in types)

    def sized(path: bytes) -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: t\r\n%sContent-Length: %d\r\n\r\n%s" % (path, head, len(body), body)

    def chunked(path: bytes) -> bytes:
        return (b"POST %s HTTP/1.1\r\nHost: t\r\n%sTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                % (path, head, len(body), body))

    answers: dict[str, bytes] = {}
    for fast in (True, False):
        with Served(fast_path=fast) as srv:
            for name, raw in (("lane", sized(LANE)), ("fast path", sized(APP)), ("chunked", chunked(LANE))):
                with srv.connect() as s:
                    s.sendall(raw)
                    answers[f"{name}, fast path {'on' if fast else 'off'}"] = undated(read_response(s))
    first = next(iter(answers.values()))
    assert first.startswith(b"HTTP/1.1 400 "), first
    assert b"Content-Type" in first.partition(b"\r\n\r\n")[2]
    assert {k: v for k, v in answers.items() if v != first} == {}
    assert lane_calls["taken"] == 0
