"""The instance registry over HTTP (LMCache 0.5.6's /instances surface), the reaper, usage,
and LMCache's exact event bodies (committed fixtures) through POST /events."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from blendmatch.index.registry import InstanceRegistry
from service_support import C, MODEL, b64, chunks, config, events, metric_samples, served, store

FIXTURES = Path(__file__).parent / "fixtures" / "lmcache"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_register_heartbeat_list_deregister():
    async with served() as (client, _):
        body = json.loads((FIXTURES / "register_request.json").read_text())  # LMCache's own serializer output
        r = await client.post("/instances", json=body)
        assert r.status_code == 200
        got = r.json()
        assert got["re_registered"] is False and got["instance_id"].startswith("mp-") and len(got["instance_id"]) == 35
        r = await client.post("/instances", json={"instance_id": " s1 ", "ip": "10.0.0.2", "http_port": 8081,
                                                  "metadata": {"zone": "a"}})
        assert r.json() == {"instance_id": "s1", "re_registered": False}
        assert (await client.post("/instances", json={"instance_id": "s1", "ip": "10.0.0.2",
                                                      "http_port": 8081})).json()["re_registered"] is True
        r = await client.put("/instances/s1/heartbeat")
        assert r.status_code == 200 and r.json() == {"instance_id": "s1"}
        r = await client.put("/instances/nope/heartbeat")
        assert r.status_code == 404 and r.json() == {"error": "unknown instance nope; re-register"}
        listed = (await client.get("/instances")).json()["instances"]
        assert [i["instance_id"] for i in listed] == [got["instance_id"], "s1"]
        assert set(listed[1]) == {"instance_id", "ip", "http_port", "registration_time", "metadata",
                                  "p2p_advertised_url", "mq_port"}
        assert listed[1]["metadata"] == {}  # replaced by the re-registration
        assert (await client.delete("/instances/s1")).status_code == 204
        assert (await client.delete("/instances/s1")).status_code == 204  # idempotent
        assert (await client.put("/instances/s1/heartbeat")).status_code == 404
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_instance_events_total{event="unknown_heartbeat"}'] == 2
        assert samples["blendmatch_instances_registered"] == 1


@pytest.mark.parametrize("body, field", [
    ({"ip": "", "http_port": 1}, "ip"),
    ({"ip": "  ", "http_port": 1}, "ip"),
    ({"ip": "h", "http_port": 0}, "http_port"),
    ({"ip": "h", "http_port": 65536}, "http_port"),
    ({"http_port": 80}, "ip"),
    ({"ip": "h", "http_port": 80, "mq_port": -1}, "mq_port"),
    ({"ip": "h", "http_port": 80, "metadata": {"a": 1}}, "metadata"),
])
async def test_bad_registration_is_a_422(body, field):
    async with served() as (client, _):
        r = await client.post("/instances", json=body)
        assert r.status_code == 422 and field in r.json()["detail"], r.text
        assert (await client.get("/instances")).json() == {"instances": []}


async def test_deregistration_fences_l1_drops_cursor_and_capacity():
    rows = chunks(2)
    async with served() as (client, _):
        await client.post("/instances", json={"instance_id": "i1", "ip": "h", "http_port": 1})
        cfg_batch = {"instance_id": "i1", "incarnation": 3, "seq": 1, "event_type": "config", "tier": "l1",
                     "backend": "dram", "capacity_bytes": 4096, "capacity_revision": 1}
        await client.post("/events", json=events(cfg_batch, store("i1", 2, rows[:1], incarnation=3, backend="dram"),
                                                 store("i1", 3, rows[1:], first_hash=1, incarnation=3, tier="l2",
                                                       backend="fs", offsets=[0])))
        usage = (await client.get("/instances/i1/usage")).json()
        assert usage["modules"][0] == {"tier": "l1", "backend": "dram", "shared": False, "used_bytes": 1024,
                                       "capacity_bytes": 4096, "usage_ratio": 0.25}
        fleet = (await client.get("/instances/usage")).json()
        assert [i["instance_id"] for i in fleet["instances"]] == ["i1"] and fleet["shared_modules"] == []
        assert (await client.delete("/instances/i1")).status_code == 204
        stats = (await client.get("/directory/stats")).json()
        assert stats["l1_count"] == 0 and stats["l2_count"] == 1 and stats["blendmatch"]["instances"] == {}
        assert stats["blendmatch"]["capacity"] == []
        # only the L2 chunk is still found
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(rows.ravel()), "model_name": MODEL})
        assert [m["cur_st"] for m in r.json()["matches"]] == [C]
        # a reconnect at a lower incarnation is not stale: the cursor went with the instance
        r = await client.post("/events", json=events(store("i1", 1, rows[:1], incarnation=0, backend="dram")))
        assert r.json()["applied"] == 1
        u = (await client.get("/instances/i1/usage")).json()
        assert u["registered"] is False and u["declared_capacity"] is False
        assert (await client.get("/instances/zz/usage")).status_code == 404


async def test_reaper_expires_silent_instances_and_fences_their_l1():
    rows = chunks(1)
    async with served(config(health_check_interval=0.05, instance_timeout=0.2)) as (client, app):
        ctx = app.state.blendmatch_context
        await client.post("/instances", json={"instance_id": "quiet", "ip": "h", "http_port": 1})
        await client.post("/instances", json={"instance_id": "chatty", "ip": "h", "http_port": 2})
        await client.post("/events", json=events(store("quiet", 1, rows, backend="dram")))
        for _ in range(10):  # chatty heartbeats through the timeout; quiet does not
            await asyncio.sleep(0.05)
            assert (await client.put("/instances/chatty/heartbeat")).status_code == 200
        assert [i["instance_id"] for i in (await client.get("/instances")).json()["instances"]] == ["chatty"]
        stats = (await client.get("/directory/stats")).json()
        assert stats["num_keys"] == 0 and "quiet" not in stats["blendmatch"]["instances"]
        assert stats["blendmatch"]["registry"]["expirations"] == 1
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_instance_events_total{event="expired"}'] == 1
        assert ctx._reaper is not None


async def test_reaper_disabled_with_interval_zero():
    async with served(config(health_check_interval=0)) as (client, app):
        assert app.state.blendmatch_context._reaper is None


def test_registry_expiry_snapshot_and_restore():
    now = [100.0]
    reg = InstanceRegistry(30.0, clock=lambda: now[0], wall_clock=lambda: 5.0)
    assert reg.register("", "h", 1)[0].startswith("mp-")
    reg.register("a", "h", 2, metadata={"k": "v"})
    now[0] = 120.0
    assert reg.heartbeat("a") and not reg.heartbeat("zz")
    now[0] = 130.0
    assert reg.expire() == []  # exactly 30 s is not more than the timeout
    now[0] = 130.5
    gone = reg.expire()
    assert len(gone) == 1 and gone[0].startswith("mp-") and reg.ids() == ["a"]
    snap = json.loads(json.dumps(reg.snapshot()))
    other = InstanceRegistry(30.0, clock=lambda: 1000.0)
    other.restore(snap)
    assert other.list() == reg.list()
    assert other.expire(1000.0 + 19.0) == [] and other.expire(1000.0 + 20.0) == ["a"]  # age 10.5 carried over
    with pytest.raises(ValueError):
        InstanceRegistry(0)


@pytest.mark.parametrize("name", ["config.json", "store.json", "access.json", "delete.json", "multi_l2.json"])
async def test_lmcache_serializer_bodies_are_accepted_byte_for_byte(name):
    """The bodies LMCache 0.5.6's own serializer wrote (tests/fixtures/lmcache, regenerated by
    tests/test_lmcache_compat.py), sent as raw bytes: never a 422."""
    async with served(config(chunk_size=4)) as (client, _):
        for earlier in ("config.json", "store.json", "access.json", "delete.json", "multi_l2.json"):
            raw = (FIXTURES / earlier).read_bytes()
            r = await client.post("/events", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200, (earlier, r.text)
            if earlier == name:
                break
        n = len(json.loads(raw)["batches"])
        assert r.json()["applied"] == n


async def test_event_reply_counts_entries_and_not_indexable_in_metrics():
    rows = chunks(3)
    bad = store("i1", 1, rows, offsets=[0, -1, 2 * C])
    bad["entries"][2]["token_ids"] = bad["entries"][2]["token_ids"][:-1]
    async with served() as (client, _):
        r = await client.post("/events", json=events(bad))
        assert r.json() == {"applied": 1, "duplicates": 0, "stale": 0, "entries_applied": 3,
                            "entries_not_indexable": {"token_offset_unknown": 1, "wrong_length": 1}}
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples["blendmatch_event_entries_applied_total"] == 3
        assert samples['blendmatch_event_entries_not_indexable_total{reason="wrong_length"}'] == 1
        assert samples['blendmatch_event_entries_not_indexable_total{reason="world_size_0"}'] == 0


async def test_directory_stats_has_lmcache_names():
    async with served() as (client, _):
        await client.post("/events", json=events(store("i1", 1, chunks(2))))
        stats = (await client.get("/directory/stats")).json()
        for name in ("num_keys", "num_placements", "l1_keys_by_instance", "l1_count", "l1_size_bytes", "l2_count",
                     "l2_size_bytes"):
            assert name in stats
        assert set(stats["blend"]) == {"num_contents", "num_chunks", "num_claims", "num_namespaces", "table_size"}
        assert "instances" not in stats and set(stats["blendmatch"]["instances"]) == {"i1"}
        assert (stats["num_keys"], stats["num_placements"], stats["l1_count"], stats["l1_size_bytes"]) == (2, 2, 2, 2048)
        assert stats["l1_keys_by_instance"] == {"i1": 2}


async def test_client_instance_ids_reach_the_log_escaped(caplog):
    """An instance id is client data: a newline in it must not forge a log line, on any of
    the registry paths (register, heartbeat, deregister, expiry) of the one event-source seam."""
    evil = "mp\nFORGED ERROR root: pwned"
    caplog.set_level("INFO")
    async with served(config(health_check_interval=0, instance_timeout=0.05)) as (client, app):
        assert (await client.post("/instances", json={"instance_id": evil, "ip": "h\rx", "http_port": 1})).status_code == 200
        assert (await client.put("/instances/mp%0AFORGED%20ERROR%20root%3A%20pwned/heartbeat")).status_code == 200
        await asyncio.sleep(0.1)
        assert await app.state.blendmatch_context.reap_once() == [evil]  # expired, then registered again to leave
        await client.post("/instances", json={"instance_id": evil, "ip": "h", "http_port": 1})
        assert (await client.delete("/instances/mp%0AFORGED%20ERROR%20root%3A%20pwned")).status_code == 204
    lines = [r.getMessage() for r in caplog.records]
    mentioning = [m for m in lines if "FORGED" in m]
    assert len(mentioning) >= 4, lines  # registered, expired (registry + fence), registered, deregistered
    assert all("\n" not in m and "\r" not in m for m in mentioning), mentioning
    assert any("mp\\x0aFORGED" in m for m in mentioning)


def test_log_path_registry_records_escape_instance_ids(caplog):
    """The Kafka side applies registry records through the same ``apply_control``; its expiry
    fence (from another replica's reaper) logs the id escaped too (it did not before)."""
    from prometheus_client import CollectorRegistry, Counter

    from blendmatch.index.key_directory import KeyDirectory
    from blendmatch.service.sources.control import apply_control

    evil = "mp\nFORGED ERROR root: pwned"
    reg, d = InstanceRegistry(30.0), KeyDirectory()
    events = Counter("t_instance_events", "t", ["event"], registry=CollectorRegistry())
    caplog.set_level("INFO")
    kw = dict(registry=reg, directory=d, instance_events=events)
    assert apply_control({"op": "register", "instance_id": evil, "ip": "h", "http_port": 1}, **kw, at=5.0).applied
    assert apply_control({"op": "heartbeat", "instance_id": evil}, **kw, at=6.0).applied
    stale = apply_control({"op": "expire", "instance_id": evil, "last_heartbeat": 5.0, "reaper": "r\n1"}, **kw)
    assert not stale.applied and reg.contains(evil)  # a heartbeat came after the sweep judged it
    out = apply_control({"op": "expire", "instance_id": evil, "reaper": "r\n1"}, **kw)
    assert out.applied and out.fenced is not None and not reg.contains(evil)
    assert events.labels("expired")._value.get() == 1 and events.labels("heartbeat")._value.get() == 1
    mentioning = [r.getMessage() for r in caplog.records if "FORGED" in r.getMessage()]
    assert mentioning and all("\n" not in m for m in mentioning), mentioning
    with pytest.raises(ValueError, match="unknown control op"):
        apply_control({"op": "nope", "instance_id": "x"}, **kw)
