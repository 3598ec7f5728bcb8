"""The drop-in match path of BlendClient (LMCache's BlendCoordinatorClient pattern) against
real loopback servers: the app under uvicorn, and a scripted server for slowness, silence,
errors and malformed answers. Plus the request_fn hook and coalescing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from blendmatch.index.types import BlendMatch, BlendNamespace
from blendmatch.service import match_pool
from blendmatch.service.app import create_app
from blendmatch.service.client import PENDING, BlendClient, BlendCoordinatorClient
from client_support import LoopbackApp, ScriptedServer, eventually, json_reply, refused_url
from service_support import C, MODEL, chunks, config, hash_of, store

SALT, WS = "tenant", 2


@dataclass(frozen=True)
class LMCacheNamespace:
    """The shape of ``lmcache.v1.mp_coordinator.api.BlendNamespace`` (what its MP server passes)."""

    model_name: str
    cache_salt: str = ""
    world_size: int = 1


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return chunks(8, seed=16)


@pytest.fixture(scope="module")
def app_url(rows):
    """The real app on a loopback port: chunks 0-5 under (MODEL, "", 1), 6-7 under (MODEL, SALT, WS)."""
    with LoopbackApp(create_app(config())) as url, BlendClient(url) as c:
        c.post_events([store("i1", 1, rows[:6]),
                       store("i2", 1, rows[6:], first_hash=6, salt=SALT, world_size=WS, offsets=[0, C])])
        yield url


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "blendmatch.service.client" and r.levelno == logging.WARNING]


def matches_of(model: str) -> dict:
    """A scripted answer whose one match names the model it was asked for."""
    return {"matches": [{"chunk_hash": model.encode().hex(), "old_st": 0, "cur_st": 0}]}


LONG = list(range(100, 100 + C))  # one chunk's worth of tokens: long enough to be sent


# ---------------------------------------------------------------------- the real app
def test_matches_found_with_the_namespace_carried(app_url, rows):
    q = np.concatenate([rows[1], rows[6], rows[3]]).tolist()  # a list, as LMCache passes
    with BlendCoordinatorClient.maybe_create(app_url, timeout=5.0, match_concurrency=2, chunk_size=C) as client:
        client.submit_match("plain", q, LMCacheNamespace(MODEL))
        client.submit_match("tenant", q, LMCacheNamespace(MODEL, SALT, WS))
        client.submit_match("other-ws", q, LMCacheNamespace(MODEL, SALT, 1))
        client.submit_match("ours", q, BlendNamespace(MODEL))
        plain = client.wait_match("plain")
        assert plain == [BlendMatch(hash_of(1), C, 0), BlendMatch(hash_of(3), 3 * C, 2 * C)]
        assert type(plain) is list and all(type(m.chunk_hash) is bytes for m in plain)
        assert client.wait_match("tenant") == [BlendMatch(hash_of(6), 0, C)]
        assert client.wait_match("other-ws") == []
        assert client.wait_match("ours") == plain == client.lookup(q, MODEL)
        assert client.match_stats()["failed"] == 0


def test_submit_is_idempotent_per_id(app_url, rows):
    with BlendClient.maybe_create(app_url, timeout=5.0, chunk_size=C) as client:
        client.submit_match("r", rows[0], MODEL)
        client.submit_match("r", rows[1], MODEL)  # ignored: "r" has an entry
        assert client.wait_match("r") == [BlendMatch(hash_of(0), 0, 0)]
        client.submit_match("r", rows[1], MODEL)  # still ignored: answered, not taken
        assert client.take_match("r") == [BlendMatch(hash_of(0), 0, 0)]
        assert client.poll_match("r") is None
        client.submit_match("r", rows[1], MODEL)  # a new query once taken
        assert client.wait_match("r") == [BlendMatch(hash_of(1), C, 0)]
        assert client.match_stats()["queries_sent"] == 2


def test_a_4xx_from_the_real_app_degrades_to_empty(app_url, caplog):
    with BlendClient.maybe_create(app_url, timeout=5.0, chunk_size=C) as client:
        client.submit_match("r", LONG, LMCacheNamespace(""))  # model_name "" -> 422
        assert client.wait_match("r") == []
    (msg,) = warnings_of(caplog)
    assert "422" in msg and "'r'" in msg


def test_1000_submits_from_16_threads_lose_and_duplicate_nothing(app_url, rows):
    rng = np.random.default_rng(7)
    queries = [np.concatenate([rows[i] for i in rng.integers(0, 8, size=3)]) for _ in range(25)]
    with BlendClient.maybe_create(app_url, timeout=10.0, match_concurrency=8, chunk_size=C) as client:
        expected = client.lookup_batch([(q, BlendNamespace(MODEL)) for q in queries])
        got: dict[int, list] = {}
        lock, start = threading.Lock(), threading.Barrier(16)

        def engine(t: int) -> None:
            mine = range(t, 1000, 16)
            start.wait(10)
            for rid in mine:
                client.submit_match(rid, queries[rid % 25], LMCacheNamespace(MODEL))
                client.submit_match(rid, queries[(rid + 1) % 25], LMCacheNamespace(MODEL))  # idempotent
            for rid in mine:
                result = client.wait_match(rid)
                assert client.take_match(rid) is result
                with lock:
                    assert rid not in got
                    got[rid] = result

        threads = [threading.Thread(target=engine, args=(t,)) for t in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert sorted(got) == list(range(1000))
        assert all(got[rid] == expected[rid % 25] for rid in got)
        stats = client.match_stats()
        assert (stats["submitted"], stats["queries_sent"], stats["answered"]) == (1000, 1000, 1000)
        assert (stats["failed"], stats["expired"], stats["discarded"], stats["entries"]) == (0, 0, 0, 0)


class GatedTransport(httpx.BaseTransport):
    """Counts requests by path and holds each until ``gate`` opens."""

    def __init__(self, gate: threading.Event) -> None:
        self.inner, self.gate, self.paths = httpx.HTTPTransport(), gate, []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        self.gate.wait(10)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_coalescing_sends_fewer_requests_with_identical_answers(app_url, rows):
    rng = np.random.default_rng(11)
    queries = [np.concatenate([rows[i] for i in rng.integers(0, 8, size=4)]) for _ in range(64)]

    def run(coalesce: bool) -> tuple[list, list[str], dict]:
        gate = threading.Event()
        transport = GatedTransport(gate)
        with BlendClient.maybe_create(app_url, timeout=10.0, match_concurrency=2, chunk_size=C,
                                      coalesce=coalesce, transport=transport) as client:
            ready = threading.Barrier(9)

            def engine(t: int) -> None:
                ready.wait(10)
                for i in range(t, 64, 8):
                    client.submit_match(i, queries[i], LMCacheNamespace(MODEL))

            threads = [threading.Thread(target=engine, args=(t,)) for t in range(8)]
            for th in threads:
                th.start()
            ready.wait(10)
            for th in threads:
                th.join(10)
            gate.set()  # all 64 submitted while at most 2 round trips were out
            answers = [client.wait_match(i) for i in range(64)]
            return answers, transport.paths, client.match_stats()

    together, paths, stats = run(coalesce=True)
    alone, alone_paths, _ = run(coalesce=False)
    assert len(alone_paths) == 64 and set(alone_paths) == {"/directory/blend-lookup"}
    assert len(paths) <= 4 and "/directory/blend-lookup/batch" in paths
    assert stats["requests"] == len(paths) and stats["queries_sent"] == 64
    with BlendClient(app_url) as c:
        assert together == alone == [c.lookup(q, MODEL) for q in queries]
    assert sum(map(len, together)) > 64  # the queries did find chunks


# ---------------------------------------------------------------------- scripted servers
def test_pending_while_the_server_is_slow():
    gate = threading.Event()

    def slow(method, path, body):
        gate.wait(10)
        return json_reply(matches_of(body["model_name"]))

    with ScriptedServer(slow) as server, BlendClient.maybe_create(server.url, timeout=5.0, chunk_size=C) as client:
        client.submit_match("r", LONG, LMCacheNamespace("m", "salt", 4))
        assert eventually(lambda: server.requests)
        polled = client.poll_match("r")
        assert polled is PENDING and polled is not None and not isinstance(polled, list)
        assert client.poll_match("r") is PENDING
        gate.set()
        assert client.wait_match("r") == [BlendMatch(b"m", 0, 0)]
        (_, path, body), = server.requests
        assert path == "/directory/blend-lookup"
        assert (body["model_name"], body["cache_salt"], body["world_size"]) == ("m", "salt", 4)
        assert np.frombuffer(__import__("base64").b64decode(body["tokens_b64"]), "<u4").tolist() == LONG


def test_silent_server_degrades_to_empty_within_the_budget(caplog):
    budget = 0.3
    with ScriptedServer(lambda *a: None) as server, \
            BlendClient.maybe_create(server.url, timeout=budget, chunk_size=C) as client:
        t0 = time.monotonic()
        client.submit_match("r", LONG, "m")
        assert client.poll_match("r") is PENDING
        while client.poll_match("r") is PENDING and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        assert client.poll_match("r") == [] and budget <= elapsed < budget + 0.5
        # the round trip times out too (request timeout = budget); still one warning in all
        assert eventually(lambda: client.match_stats()["discarded"] + client.match_stats()["failed"] == 1)
    assert len(warnings_of(caplog)) == 1


def test_queued_queries_resolve_within_the_budget_too():
    with ScriptedServer(lambda *a: None) as server, \
            BlendClient.maybe_create(server.url, timeout=0.2, match_concurrency=1, chunk_size=C) as client:
        t0 = time.monotonic()
        for rid in range(5):  # one in flight, four waiting behind it
            client.submit_match(rid, LONG, "m")
        assert [client.wait_match(rid) for rid in range(5)] == [[]] * 5
        assert time.monotonic() - t0 < 0.2 + 0.5


def test_refused_connection_degrades_to_empty(caplog):
    with BlendClient.maybe_create(refused_url(), timeout=2.0, chunk_size=C) as client:
        t0 = time.monotonic()
        client.submit_match("r", LONG, "m")
        assert client.wait_match("r") == [] and time.monotonic() - t0 < 1.5
    (msg,) = warnings_of(caplog)
    assert "ConnectError" in msg or "refused" in msg.lower()


@pytest.mark.parametrize("reply, words", [
    (json_reply({"detail": "boom"}, 500), ["500", "boom"]),
    ((200, b"{not json"), ["JSONDecodeError"]),
    (json_reply({"matches": [{"chunk_hash": "zz", "old_st": 0, "cur_st": 0}]}), ["ValueError"]),
    (json_reply({"no": "matches"}), ["KeyError"]),
])
def test_error_statuses_and_malformed_answers_degrade_to_empty(caplog, reply, words):
    with ScriptedServer(lambda *a: reply) as server, \
            BlendClient.maybe_create(server.url, timeout=2.0, chunk_size=C) as client:
        client.submit_match("r", LONG, "m")
        assert client.wait_match("r") == []
    (msg,) = warnings_of(caplog)
    assert all(w in msg for w in words), msg


def test_take_clears_the_entry_and_a_late_answer_is_discarded():
    slow_gate = threading.Event()

    def script(method, path, body):
        if body["model_name"] == "slow":
            slow_gate.wait(10)
        return json_reply(matches_of(body["model_name"]))

    with ScriptedServer(script) as server, \
            BlendClient.maybe_create(server.url, timeout=5.0, match_concurrency=2, chunk_size=C) as client:
        client.submit_match("r", LONG, "slow")
        assert eventually(lambda: server.requests)
        assert client.take_match("r") is PENDING
        assert client.poll_match("r") is None
        client.submit_match("r", LONG, "fast")  # the same id, a new query
        assert client.wait_match("r") == [BlendMatch(b"fast", 0, 0)]
        slow_gate.set()
        assert eventually(lambda: client.match_stats()["discarded"] == 1)
        assert server.answered == 2
        assert client.poll_match("r") == [BlendMatch(b"fast", 0, 0)]  # not overwritten by the late one
        client.take_match("r")
        assert client.poll_match("r") is None


def test_no_batch_endpoint_falls_back_to_one_request_per_query(caplog):
    gate = threading.Event()

    def lmcache_like(method, path, body):
        gate.wait(10)
        if path.endswith("/batch"):
            return json_reply({"detail": "Not Found"}, 404)
        return json_reply(matches_of(body["model_name"]))

    with ScriptedServer(lmcache_like) as server, \
            BlendClient.maybe_create(server.url, timeout=5.0, match_concurrency=1, chunk_size=C) as client:
        for i in range(4):
            client.submit_match(i, LONG, f"m{i}")
        gate.set()
        assert [client.wait_match(i) for i in range(4)] == [[BlendMatch(f"m{i}".encode(), 0, 0)] for i in range(4)]
        client.submit_match(9, LONG, "m9")
        client.submit_match(10, LONG, "m10")
        assert client.wait_match(10) == [BlendMatch(b"m10", 0, 0)]
    assert server.paths().count("/directory/blend-lookup/batch") == 1
    (msg,) = warnings_of(caplog)
    assert "no batch lookup endpoint" in msg


# ---------------------------------------------------------------------- no server at all
def test_maybe_create_rules(app_url):
    for blank in (None, "", "   ", "\t\n"):
        assert BlendCoordinatorClient.maybe_create(blank, timeout=1.0, match_concurrency=8) is None
    with pytest.raises(ValueError, match="match_concurrency"):
        BlendClient.maybe_create(app_url, timeout=1.0, match_concurrency=0)
    with pytest.raises(ValueError, match="match_concurrency"):
        BlendCoordinatorClient("http://x", match_concurrency=-1)
    with pytest.raises(ValueError, match="match_budget_s"):
        BlendClient("http://x", match_budget_s=0)
    client = BlendClient.maybe_create(f" {app_url} ", timeout=0.25, match_concurrency=3)
    try:
        assert (client.match_budget_s, client.request_timeout, client.match_concurrency) == (0.25, 0.25, 3)
        assert client.match_stats()["workers"] == 3  # started before any submit
        assert client.healthz()
    finally:
        client.close()
    assert client.match_stats()["workers"] == 0  # close stops the workers
    client.submit_match("late", LONG, MODEL)  # ignored after close, does not raise
    assert client.poll_match("late") is None
    client.close()  # idempotent


def test_request_fn_hook_single_batch_and_failure(caplog):
    calls: list[tuple[str, str, dict]] = []
    gate = threading.Event()

    def request_fn(method: str, path: str, payload: dict) -> dict:
        calls.append((method, path, payload))
        gate.wait(10)
        if path == "/directory/blend-lookup":
            if payload["model_name"] == "broken":
                raise RuntimeError("transport down")
            return matches_of(payload["model_name"])
        return {"results": [matches_of(q["model_name"]) for q in payload["queries"]]}

    client = BlendCoordinatorClient(request_fn=request_fn, match_concurrency=1, chunk_size=C, coalesce=True)
    try:
        client.submit_match(0, LONG, LMCacheNamespace("m0", "s", 2))
        assert eventually(lambda: calls)  # the one worker is busy with query 0 ...
        for i in range(1, 10):
            client.submit_match(i, LONG, LMCacheNamespace(f"m{i}", "s", 2))
        gate.set()  # ... so 1-9 wait together and travel as one batch
        assert [client.wait_match(i) for i in range(10)] == [[BlendMatch(f"m{i}".encode(), 0, 0)] for i in range(10)]
        assert [(m, p) for m, p, _ in calls] == [("POST", "/directory/blend-lookup"),
                                                  ("POST", "/directory/blend-lookup/batch")]
        assert set(calls[0][2]) == {"tokens_b64", "model_name", "cache_salt", "world_size"}
        assert calls[0][2]["cache_salt"] == "s" and calls[0][2]["world_size"] == 2
        assert [q["model_name"] for q in calls[1][2]["queries"]] == [f"m{i}" for i in range(1, 10)]
        client.submit_match("b", LONG, "broken")
        assert client.wait_match("b") == []
        (msg,) = warnings_of(caplog)
        assert "RuntimeError: transport down" in msg
    finally:
        client.close()


def test_short_queries_are_answered_without_a_round_trip():
    calls = []
    client = BlendClient(request_fn=lambda *a: calls.append(a) or matches_of("m"), chunk_size=C)
    try:
        client.submit_match("short", LONG[:-1], "m")
        assert client.poll_match("short") == [] and calls == []
        client.submit_match("empty", [], "m")
        assert client.poll_match("empty") == []
        client.submit_match("full", LONG, "m")
        assert client.wait_match("full") == [BlendMatch(b"m", 0, 0)] and len(calls) == 1
        assert client.match_stats()["short"] == 2
    finally:
        client.close()


def test_the_chunk_size_is_learned_from_the_server_when_not_given(app_url, rows):
    with BlendClient.maybe_create(app_url, timeout=5.0) as client:  # as LMCache calls it: no chunk size
        assert eventually(lambda: client.match_stats()["chunk_size"] == C) and client.chunk_size == C
        client.submit_match("short", rows[0][:-1], MODEL)
        assert client.poll_match("short") == [] and client.match_stats()["requests"] == 0

    calls = []

    def lmcache_calls_only(method, path, payload):
        calls.append((method, path))
        if (method, path) != ("POST", "/directory/blend-lookup"):
            raise AssertionError(f"unexpected {method} {path}")  # as LMCache's own test hook does
        return matches_of("m")

    client = BlendClient(request_fn=lmcache_calls_only)
    try:
        for i in range(8):  # unknown chunk size: sent, never guessed short; never coalesced
            client.submit_match(f"tiny{i}", [1, 2, 3], "m")
        assert [client.wait_match(f"tiny{i}") for i in range(8)] == [[BlendMatch(b"m", 0, 0)]] * 8
        client.submit_match("empty", [], "m")
        assert client.poll_match("empty") == []
        assert client.chunk_size is None and not client.coalesce
        assert calls == [("POST", "/directory/blend-lookup")] * 8  # never GET /directory/stats, never /batch
    finally:
        client.close()


def test_nothing_on_the_submit_and_poll_path_raises(caplog):
    client = BlendClient(request_fn=lambda *a: matches_of("m"), chunk_size=C)
    try:
        client.submit_match("no-len", None, "m")  # tokens without a length
        client.submit_match("no-ns", LONG, None)  # a namespace without a model_name
        client.submit_match("bad-ids", [-1] * C, "m")  # not uint32: fails on the worker
        client.submit_match(["unhashable"], LONG, "m")
        assert client.poll_match("no-len") == [] and client.poll_match("no-ns") == []
        assert client.wait_match("bad-ids") == []
        assert client.poll_match(["unhashable"]) is None and client.take_match(["unhashable"]) is None
        assert client.poll_match("never-submitted") is None
        assert client.match_stats()["requests"] == 0
        assert len(warnings_of(caplog)) == 4
    finally:
        client.close()
    assert BlendClient("http://x").poll_match("r") is None  # no worker pool yet


# ---------------------------------------------------------------------- pieces
def test_pending_is_lmcaches_own_sentinel_inside_an_lmcache_process(monkeypatch):
    assert repr(PENDING) == "PENDING" and PENDING is match_pool.PENDING
    theirs = object()
    fake = types.ModuleType("lmcache.v1.mp_coordinator.blend_client")
    fake.PENDING = theirs
    for name in ("lmcache", "lmcache.v1", "lmcache.v1.mp_coordinator"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "lmcache.v1.mp_coordinator.blend_client", fake)
    assert match_pool._lmcache_pending() is theirs
    monkeypatch.delitem(sys.modules, "lmcache")
    assert match_pool._lmcache_pending() is None  # LMCache not loaded: never imported by us


def test_warn_limiter_holds_back_identical_warnings(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(match_pool.time, "monotonic", lambda: now[0])
    limiter = match_pool.WarnLimiter(interval_s=10.0)
    for _ in range(3):
        limiter.warn("k", "down: %s", "x")
    limiter.warn("other", "different")
    now[0] += 10.0
    limiter.warn("k", "down: %s", "x")
    assert warnings_of(caplog) == ["down: x", "different",
                                   "down: x (2 similar warnings in the last 10 s not logged)"]


@pytest.mark.skipif(not os.environ.get("BLENDMATCH_LMCACHE_WHEEL"),
                    reason="set BLENDMATCH_LMCACHE_WHEEL to an unzipped lmcache 0.5.6 wheel to compare with its client")
def test_same_answers_and_sentinel_as_lmcaches_own_client():
    script = Path(__file__).with_name("lmcache_dropin_check.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr
