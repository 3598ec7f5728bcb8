"""``--upstream-coordinator``: blendmatch in front of an LMCache coordinator.

The upstream is a stub FastAPI app under uvicorn on a real loopback port that records every
request it receives and answers as LMCache's coordinator does where it matters (a heartbeat
for an unknown instance is a 404 with ``{"error": ...}``). blendmatch runs in-process; its
calls to the upstream go over the real socket.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response

from blendmatch.service.cli import build_parser, config_from_args
from client_support import LoopbackApp
from service_support import MODEL, b64, chunks, config, events, metric_samples, served, store

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class StubUpstream:
    """Records ``(method, raw path, query, body, headers)``; knows registered instances."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.known: set[str] = set()
        self.hang_s = 0.0
        self.events_status = 0  # non-zero: POST /events answers this status
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def anything(request: Request, path: str) -> Response:
            body = await request.body()
            raw = request.scope["raw_path"].decode()
            self.received.append({"method": request.method, "path": raw, "query": request.url.query,
                                  "body": body, "headers": dict(request.headers)})
            if self.hang_s and raw != "/stub/ping":
                await asyncio.sleep(self.hang_s)
            return self.answer(request.method, raw, body)

        self.app = app

    def answer(self, method: str, path: str, body: bytes) -> Response:
        if method == "POST" and path == "/instances":
            iid = json.loads(body)["instance_id"]
            again = iid in self.known
            self.known.add(iid)
            return _json({"instance_id": iid, "re_registered": again})
        if method == "PUT" and path.endswith("/heartbeat"):
            iid = path.split("/")[2]
            if iid not in self.known:
                return _json({"error": f"unknown instance {iid}; re-register"}, 404)
            return _json({"instance_id": iid})
        if method == "DELETE" and path.startswith("/instances/"):
            self.known.discard(path.split("/")[2])
            return Response(status_code=204)
        if method == "POST" and path == "/events" and self.events_status:
            return _json({"detail": "nope"}, self.events_status)
        if method == "POST" and path == "/events":
            return _json({"applied": len(json.loads(body)["batches"]), "duplicates": 0, "stale": 0})
        if path == "/quota/config" and method == "PUT":
            limit = json.loads(body).get("default_limit_gb")
            if limit is not None and limit < 0:
                return _json({"detail": "default_limit_gb must be >= 0"}, 422)
            return _json({"default_limit_gb": limit})
        if path.startswith("/quota/"):
            return _json({"cache_salt": path.split("/", 2)[2], "quota_limit_gb": 1.5, "quota_exists": True,
                          "usage_gb": 0.25})
        if path == "/cache/pins" and method == "POST":
            return _json({"requested": 1, "affected": 1, "status": "pinned"})
        if path == "/directory/lookup":
            return _json({"chunks": 0, "results": [], "from": "upstream"})
        return _json({"detail": "Not Found"}, 404)

    def of(self, method: str, path: str) -> list[dict[str, Any]]:
        return [r for r in self.received if r["method"] == method and r["path"] == path]


def _json(content: Any, status: int = 200) -> Response:
    return Response(json.dumps(content).encode(), status_code=status, media_type="application/json")


@pytest.fixture
def stub():
    up = StubUpstream()
    with LoopbackApp(up.app) as url:
        up.url = url
        yield up


def _closed_port_url() -> str:
    """A loopback port nothing listens on (bound, then closed: connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


async def _idle(app: Any, timeout_s: float = 5.0) -> None:
    assert await app.state.blendmatch_context.upstream.wait_idle(timeout_s), "forwards did not drain"


async def test_unknown_endpoints_are_proxied(stub):
    async with served(config(upstream_coordinator=stub.url)) as (client, app):
        r = await client.get("/quota/tenant%2Fa", params={"tier": "l2"}, headers={"authorization": "Bearer ours"})
        assert r.status_code == 200 and r.json()["quota_limit_gb"] == 1.5
        assert r.headers["content-type"] == "application/json"
        got = stub.of("GET", "/quota/tenant%2Fa")  # percent-encoding kept: one path segment
        assert len(got) == 1 and got[0]["query"] == "tier=l2"
        assert "authorization" not in got[0]["headers"]  # our credentials stay here

        pin = json.dumps({"model_name": MODEL, "world_size": 1, "token_ids": [1, 2, 3]}).encode()
        r = await client.post("/cache/pins", content=pin, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["status"] == "pinned"
        sent = stub.of("POST", "/cache/pins")[0]
        assert sent["body"] == pin and sent["headers"]["content-type"] == "application/json"

        # the upstream's error statuses and bodies come back unchanged
        r = await client.put("/quota/config", json={"default_limit_gb": -1})
        assert r.status_code == 422 and r.json() == {"detail": "default_limit_gb must be >= 0"}
        r = await client.get("/no/such/thing")
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert len(stub.of("GET", "/no/such/thing")) == 1

        # what we serve is answered here and never reaches the upstream
        for path in ("/healthz", "/directory/stats", "/instances", "/directory/keys"):
            assert (await client.get(path)).status_code == 200
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(chunks(1)[0]), "model_name": MODEL})
        assert r.status_code == 200
        assert [x["path"] for x in stub.received] == ["/quota/tenant%2Fa", "/cache/pins", "/quota/config",
                                                       "/no/such/thing"]
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_upstream_proxy_requests_total{outcome="answered"}'] == 4
        # the catch-all is not part of our contract
        assert all("{path}" not in p for p in app.openapi()["paths"])


async def test_both_forms_of_directory_lookup_are_answered_here(stub):
    body = {"token_ids": list(range(300)), "model_name": MODEL}
    async with served(config(upstream_coordinator=stub.url)) as (client, _):
        r = await client.post("/directory/lookup", json=body)  # the token hasher is ours now
        assert r.status_code == 200 and r.json()["chunks"] == 300 // 16 and "from" not in r.json()
        r = await client.post("/directory/lookup", json={"keys": [{"chunk_hash_hex": "ab", "model_name": MODEL,
                                                                   "kv_rank": 0}]})
        assert r.status_code == 200 and r.json()["chunks"] == 1
        assert stub.of("POST", "/directory/lookup") == []


async def test_events_and_registry_calls_are_applied_here_and_forwarded_in_order(stub):
    rows = chunks(3, seed=4)
    async with served(config(upstream_coordinator=stub.url)) as (client, app):
        r = await client.post("/instances", json={"ip": "10.0.0.7", "http_port": 8000, "metadata": {"a": "b"}})
        iid = r.json()["instance_id"]
        assert iid.startswith("mp-")
        assert (await client.put(f"/instances/{iid}/heartbeat")).status_code == 200
        raw = json.dumps(events(store(iid, 1, rows))).encode()
        r = await client.post("/events", content=raw, headers={"content-type": "application/json"})
        assert r.json()["applied"] == 1
        # applied here: the blend lookup finds the stored chunks
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(rows.reshape(-1)), "model_name": MODEL})
        assert [m["cur_st"] for m in r.json()["matches"]] == [0, 16, 32]
        assert (await client.delete(f"/instances/{iid}")).status_code == 204
        await _idle(app)
        assert [(x["method"], x["path"]) for x in stub.received] == [
            ("POST", "/instances"), ("PUT", f"/instances/{iid}/heartbeat"), ("POST", "/events"),
            ("DELETE", f"/instances/{iid}")]
        reg = json.loads(stub.received[0]["body"])
        assert reg["instance_id"] == iid and reg["ip"] == "10.0.0.7" and reg["metadata"] == {"a": "b"}
        assert stub.received[2]["body"] == raw  # the same bytes
        # an unknown heartbeat is a 404 here and goes nowhere; a rejected event request too
        assert (await client.put("/instances/nobody/heartbeat")).status_code == 404
        assert (await client.post("/events", json={"batches": [{"instance_id": ""}]})).status_code == 422
        await _idle(app)
        assert len(stub.received) == 4
        samples = metric_samples((await client.get("/metrics")).text)
        for kind in ("register", "heartbeat", "events", "deregister"):
            assert samples[f'blendmatch_upstream_forwarded_total{{kind="{kind}"}}'] == 1


async def test_heartbeat_unknown_upstream_re_sends_the_registration(stub):
    async with served(config(upstream_coordinator=stub.url)) as (client, app):
        await client.post("/instances", json={"instance_id": "mp-1", "ip": "10.0.0.8", "http_port": 8001})
        await _idle(app)
        stub.known.clear()  # the upstream restarted and forgot it
        assert (await client.put("/instances/mp-1/heartbeat")).status_code == 200
        await _idle(app)
        assert [(x["method"], x["path"]) for x in stub.received] == [
            ("POST", "/instances"), ("PUT", "/instances/mp-1/heartbeat"), ("POST", "/instances")]
        assert json.loads(stub.received[2]["body"])["ip"] == "10.0.0.8" and "mp-1" in stub.known
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples["blendmatch_upstream_reregistrations_total"] == 1


async def test_unreachable_upstream_never_blocks_lookups_and_is_counted(caplog):
    url = _closed_port_url()
    rows = chunks(2, seed=9)
    cfg = config(upstream_coordinator=url, upstream_timeout=0.5, upstream_connect_timeout=0.2)
    with caplog.at_level("WARNING", logger="blendmatch.service.upstream"):
        async with served(cfg) as (client, _):
            t0 = time.perf_counter()
            r = await client.post("/events", json=events(store("i1", 1, rows)))
            assert r.status_code == 200 and r.json()["applied"] == 1
            await client.post("/instances", json={"instance_id": "i1", "ip": "10.0.0.9", "http_port": 8002})
            worst = 0.0
            for _ in range(20):
                t = time.perf_counter()
                r = await client.post("/directory/blend-lookup",
                                      json={"tokens_b64": b64(rows.reshape(-1)), "model_name": MODEL})
                worst = max(worst, time.perf_counter() - t)
                assert [m["cur_st"] for m in r.json()["matches"]] == [0, 16]
            assert worst < 0.25, f"a lookup took {worst:.3f} s with the upstream down"
            r = await client.get("/quota")
            assert r.status_code == 502 and url in r.json()["detail"]
            assert time.perf_counter() - t0 < 2.0
            await asyncio.sleep(0.3)  # the drainer retries meanwhile (backoff from 0.1 s)
            samples = metric_samples((await client.get("/metrics")).text)
            assert samples['blendmatch_upstream_forward_failures_total{kind="events",reason="unreachable"}'] >= 1
            assert samples['blendmatch_upstream_proxy_requests_total{outcome="unreachable"}'] == 1
            assert samples["blendmatch_upstream_queue_depth"] == 2  # the events and the registration, kept
        stop_s = time.perf_counter()
    warnings = [r.getMessage() for r in caplog.records if r.name == "blendmatch.service.upstream"]
    assert sum("further failures are counted" in w for w in warnings) == 1, warnings  # once per burst
    assert any("not delivered" in w for w in warnings), warnings  # what the stop left behind is said
    assert stop_s - t0 < 3.0


async def test_a_hanging_upstream_delays_no_reply(stub):
    stub.hang_s = 1.0
    cfg = config(upstream_coordinator=stub.url, upstream_timeout=0.3)
    async with served(cfg) as (client, app):
        t = time.perf_counter()
        r = await client.post("/events", json=events(store("i1", 1, chunks(1))))
        assert r.status_code == 200 and time.perf_counter() - t < 0.2
        t = time.perf_counter()
        r = await client.get("/quota")
        took = time.perf_counter() - t
        assert r.status_code == 504 and "did not answer" in r.json()["detail"] and 0.25 < took < 0.9
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_upstream_proxy_requests_total{outcome="timeout"}'] == 1


async def test_upstream_errors_are_retried_or_dropped_and_order_is_kept(stub):
    async with served(config(upstream_coordinator=stub.url)) as (client, app):
        stub.events_status = 503  # a 5xx: retried, then given up
        await client.post("/events", json=events(store("i1", 1, chunks(1))))
        await client.post("/instances", json={"instance_id": "i1", "ip": "10.0.0.2", "http_port": 8000})
        await _idle(app)
        assert [x["path"] for x in stub.received] == ["/events"] * 3 + ["/instances"]  # behind it, in order
        stub.events_status = 404  # a 4xx (an upstream in Kafka mode): dropped at once
        await client.post("/events", json=events(store("i1", 2, chunks(1, seed=2))))
        await _idle(app)
        assert len(stub.of("POST", "/events")) == 4
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_upstream_forward_failures_total{kind="events",reason="http_5xx"}'] == 3
        assert samples['blendmatch_upstream_forward_dropped_total{kind="events",reason="gave_up"}'] == 1
        assert samples['blendmatch_upstream_forward_dropped_total{kind="events",reason="rejected"}'] == 1
        assert samples['blendmatch_upstream_forwarded_total{kind="register"}'] == 1


async def test_a_full_forward_queue_drops_the_oldest():
    cfg = config(upstream_coordinator=_closed_port_url(), upstream_queue_size=2, upstream_timeout=0.2)
    async with served(cfg) as (client, app):
        await client.post("/instances", json={"instance_id": "i1", "ip": "10.0.0.1", "http_port": 8000})
        for _ in range(4):
            assert (await client.put("/instances/i1/heartbeat")).status_code == 200
        up = app.state.blendmatch_context.upstream
        assert up.pending == 2
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_upstream_forward_dropped_total{kind="register",reason="overflow"}'] == 1
        assert samples['blendmatch_upstream_forward_dropped_total{kind="heartbeat",reason="overflow"}'] == 2


async def test_the_forward_queue_is_bounded_in_bytes_too():
    cfg = config(upstream_coordinator=_closed_port_url(), upstream_queue_bytes=1200, upstream_timeout=0.2)
    async with served(cfg) as (client, app):
        up = app.state.blendmatch_context.upstream
        sizes = []
        for seq in range(1, 6):
            raw = json.dumps(events(store("i1", seq, chunks(1, seed=seq)))).encode()
            sizes.append(len(raw))
            r = await client.post("/events", content=raw, headers={"content-type": "application/json"})
            assert r.json()["applied"] == 1
        assert 300 < sizes[0] < 600
        kept = up.pending
        assert kept < 5 and sum(sizes[-kept:]) <= 1200 < sum(sizes[-kept - 1:])
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_upstream_forward_dropped_total{kind="events",reason="overflow"}'] == 5 - kept


async def test_without_upstream_unknown_paths_are_404_as_before():
    async with served() as (client, app):
        assert app.state.blendmatch_context.upstream is None
        for path in ("/quota", "/cache/pins", "/nope"):
            r = await client.get(path)
            assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert (await client.post("/cache/pins", json={})).status_code == 404
        assert (await client.get("/events")).status_code == 405
        assert "blendmatch_upstream" not in (await client.get("/metrics")).text


def test_cli_flag():
    parser = build_parser()
    args = parser.parse_args(["serve", "--upstream-coordinator", "lmcache-coord:9300", "--upstream-timeout", "3"])
    cfg = config_from_args(args)
    assert cfg.upstream_coordinator == "http://lmcache-coord:9300" and cfg.upstream_timeout == 3.0
    assert config_from_args(parser.parse_args(["serve"])).upstream_coordinator == ""
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()  # noqa: SLF001
    assert "--upstream-coordinator URL" in help_text
