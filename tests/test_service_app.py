"""The HTTP app in-process: every endpoint's happy path and LMCache wire shapes."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from blendmatch.bench import kafka as kafka_bench, loadtest
from blendmatch.index.wire_models import wire_batch, wire_entry
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import pack_kv_rank
from service_support import C, MODEL, b64, chunks, config, events, hash_of, metric_samples, served, store

pytestmark = pytest.mark.anyio


def _batch_counts(reply: dict) -> dict:
    """LMCache's three batch counts of a POST /events reply (ours add per-entry fields)."""
    return {k: reply[k] for k in ("applied", "duplicates", "stale")}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def query_with(rows: np.ndarray, at: list[int], length: int, seed: int = 7) -> np.ndarray:
    """A query of ``length`` random tokens (ids >= 60,000, so nothing stored matches by
    accident) with ``rows[k]`` written at ``at[k]``."""
    q = np.random.default_rng(seed).integers(60_000, 70_000, size=length, dtype=np.uint32)
    for row, pos in zip(rows, at, strict=True):
        q[pos:pos + row.shape[0]] = row
    return q


async def test_healthz_and_engine_in_stats():
    async with served() as (client, _):
        r = await client.get("/healthz")
        assert r.status_code == 200 and r.json() == {"status": "healthy"}
        stats = (await client.get("/directory/stats")).json()
        ours = stats.pop("blendmatch")
        assert ours["engine"] == {"name": "cpu", "reason": "asked for by name"}
        assert ours["chunk_size"] == C and ours["blend"]["chunk_size"] == C
        assert ours["keys"] == 0 and ours["batcher"]["batches"] == 0
        # LMCache's names only, at the top and in "blend" (its tests assert what is absent)
        assert set(stats) == {"num_keys", "num_placements", "l1_keys_by_instance", "blend", "l1_count",
                              "l1_size_bytes", "l2_count", "l2_size_bytes"}
        assert stats["blend"] == {"num_contents": 0, "num_chunks": 0, "num_claims": 0, "num_namespaces": 0,
                                  "table_size": 1024}
        # the tools that read this body read the same shape (an old-shape body fails loudly)
        assert kafka_bench.log_stats({**stats, "blendmatch": ours}) is None  # HTTP mode: no log
        assert kafka_bench.log_stats({"blendmatch": {"log": {"records_applied": 3}}}) == {"records_applied": 3}
        with pytest.raises(KeyError):
            kafka_bench.log_stats({"log": {"records_applied": 3}})
        assert loadtest._replica_of({**stats, "blendmatch": ours}) is None


async def test_store_then_blend_lookup_both_token_forms():
    rows = chunks(4)
    async with served() as (client, _):
        r = await client.post("/events", json=events(store("i1", 1, rows, offsets=[0, 16, 32, 512])))
        assert r.status_code == 200 and _batch_counts(r.json()) == {"applied": 1, "duplicates": 0, "stale": 0}
        q = query_with(rows[[3, 1]], at=[5, 40], length=100)
        want = [{"chunk_hash": hash_of(3).hex(), "old_st": 512, "cur_st": 5},
                {"chunk_hash": hash_of(1).hex(), "old_st": 16, "cur_st": 40}]
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(q), "model_name": MODEL})
        assert r.status_code == 200, r.text
        assert r.json() == {"matches": want}
        r = await client.post("/directory/blend-lookup", json={"token_ids": q.tolist(), "model_name": MODEL,
                                                                "world_size": 1, "cache_salt": ""})
        assert r.json() == {"matches": want}
        assert all(m["chunk_hash"] == m["chunk_hash"].lower() for m in r.json()["matches"])


async def test_namespace_scopes_matches():
    rows = chunks(2)
    async with served() as (client, _):
        await client.post("/events", json=events(store("i1", 1, rows[:1], salt="tenant-a"),
                                                 store("i2", 1, rows[1:], first_hash=1, world_size=2)))
        q = query_with(rows, at=[0, 20], length=64)
        async def look(**ns):
            r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(q), **ns})
            return [m["cur_st"] for m in r.json()["matches"]]
        assert await look(model_name=MODEL, cache_salt="tenant-a") == [0]
        assert await look(model_name=MODEL, world_size=2) == [20]
        assert await look(model_name=MODEL) == []
        assert await look(model_name="other", cache_salt="tenant-a") == []


async def test_batch_endpoint_one_result_per_query_in_order():
    rows = chunks(3)
    async with served() as (client, _):
        await client.post("/events", json=events(store("i1", 1, rows), store("i2", 1, rows[:1], first_hash=10,
                                                                              salt="s")))
        qs = [query_with(rows[[0]], [0], 40), query_with(rows[[2, 1]], [3, 30], 64), np.zeros(3, np.uint32),
              query_with(rows[[0]], [8], 40)]
        body = {"queries": [
            {"tokens_b64": b64(qs[0]), "model_name": MODEL},
            {"token_ids": qs[1].tolist(), "model_name": MODEL},
            {"tokens_b64": b64(qs[2]), "model_name": MODEL},
            {"tokens_b64": b64(qs[3]), "model_name": MODEL, "cache_salt": "s"},
        ]}
        r = await client.post("/directory/blend-lookup/batch", json=body)
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [[m["cur_st"] for m in x["matches"]] for x in res] == [[0], [3, 30], [], [8]]
        assert res[3]["matches"][0]["chunk_hash"] == hash_of(10).hex()
        assert (await client.post("/directory/blend-lookup/batch", json={"queries": []})).json() == {"results": []}


async def test_concurrent_lookups_share_batches_and_answer_correctly():
    rows = chunks(32)
    async with served() as (client, app):
        await client.post("/events", json=events(store("i1", 1, rows)))
        qs = [query_with(rows[[i]], [i], 64, seed=i) for i in range(32)]
        rs = await asyncio.gather(*(client.post("/directory/blend-lookup",
                                                json={"tokens_b64": b64(q), "model_name": MODEL}) for q in qs))
        for i, r in enumerate(rs):
            assert r.json()["matches"] == [{"chunk_hash": hash_of(i).hex(), "old_st": i * C, "cur_st": i}]
        batcher = (await client.get("/directory/stats")).json()["blendmatch"]["batcher"]
        assert batcher["queries"] == 32 and batcher["failed_batches"] == 0


async def test_blend_lookup_disabled_answers_no_matches():
    rows = chunks(1)
    async with served(config(enable_blend_lookup=False)) as (client, _):
        await client.post("/events", json=events(store("i1", 1, rows)))
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(rows[0]), "model_name": MODEL})
        assert r.status_code == 200 and r.json() == {"matches": []}
        r = await client.post("/directory/blend-lookup/batch",
                              json={"queries": [{"tokens_b64": b64(rows[0]), "model_name": MODEL}]})
        assert r.json() == {"results": [{"matches": []}]}
        stats = (await client.get("/directory/stats")).json()
        assert stats["blendmatch"]["engine"]["name"] == "none" and stats["blendmatch"]["keys"] == 1
        assert stats["blend"] == {"num_contents": 0, "num_chunks": 0, "num_claims": 0, "num_namespaces": 0,
                                  "table_size": 0}
        # bad input is still rejected when disabled
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": "@@", "model_name": MODEL})
        assert r.status_code == 422


async def test_events_duplicates_and_stale_are_counted():
    rows = chunks(2)
    async with served() as (client, _):
        body = events(store("i1", 1, rows[:1], incarnation=1))
        assert _batch_counts((await client.post("/events", json=body)).json()) == {"applied": 1, "duplicates": 0, "stale": 0}
        assert _batch_counts((await client.post("/events", json=body)).json()) == {"applied": 0, "duplicates": 1, "stale": 0}
        old = events(store("i1", 5, rows[1:], first_hash=1, incarnation=0))
        assert _batch_counts((await client.post("/events", json=old)).json()) == {"applied": 0, "duplicates": 0, "stale": 1}


async def test_directory_lookup_keys_and_fence():
    rows = chunks(3)
    async with served() as (client, _):
        await client.post("/events", json=events(store("i1", 1, rows), store("i2", 1, rows[:1], tier="l2",
                                                                              backend="fs")))
        key0 = {"chunk_hash_hex": hash_of(0).hex(), "model_name": MODEL, "kv_rank": pack_kv_rank(1)}
        unknown = {**key0, "chunk_hash_hex": "00ff"}
        r = await client.post("/directory/lookup", json={"keys": [key0, unknown]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["chunks"] == 2
        first, second = body["results"]
        assert first["key"]["chunk_hash_hex"] == hash_of(0).hex()
        assert sorted((p["instance_id"], p["tier"]) for p in first["placements"]) == [("i1", "l1"), ("i2", "l2")]
        assert first["token_ids"] == rows[0].tolist()
        assert second == {"key": {**unknown, "object_group_id": 0, "cache_salt": ""}, "placements": [],
                          "token_ids": [], "access_count": 0}  # LMCache: unknown keys get empty lists and 0

        page = (await client.get("/directory/keys", params={"limit": 2})).json()
        assert page["total"] == 3 and len(page["keys"]) == 2 and page["next_offset"] == 2
        assert page["keys"][0]["num_tokens"] == C
        last = (await client.get("/directory/keys", params={"limit": 2, "offset": 2})).json()
        assert len(last["keys"]) == 1 and last["next_offset"] is None
        l2 = (await client.get("/directory/keys", params={"tier": "l2"})).json()
        assert l2["total"] == 1 and l2["keys"][0]["placements"][0]["backend"] == "fs"
        assert (await client.get("/directory/keys", params={"instance_id": "i2"})).json()["total"] == 1

        r = await client.delete("/instances/i1")
        assert r.status_code == 204
        q = query_with(rows, [0, 16, 32], 64)
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(q), "model_name": MODEL})
        assert [m["chunk_hash"] for m in r.json()["matches"]] == [hash_of(0).hex()]  # only the L2 copy is left
        assert (await client.get("/directory/stats")).json()["num_keys"] == 1
        assert (await client.delete("/instances/never-seen")).status_code == 204


async def test_metrics_expose_the_promised_series():
    rows = chunks(2)
    async with served() as (client, _):
        await client.post("/events", json=events(store("i1", 1, rows)))
        await client.post("/events", json=events(store("i1", 1, rows)))
        q = query_with(rows, [0, 20], 64)
        for _ in range(3):
            await client.post("/directory/blend-lookup", json={"tokens_b64": b64(q), "model_name": MODEL})
        await client.post("/directory/blend-lookup", json={"tokens_b64": "!", "model_name": MODEL})
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        for name in ("blendmatch_lookup_latency_seconds_bucket", "blendmatch_batch_queries_count",
                     "blendmatch_batch_tokens_sum", "blendmatch_queue_wait_seconds_count",
                     "blendmatch_engine_seconds_count", "blendmatch_verify_seconds_count",
                     "blendmatch_windows_probed_total", "blendmatch_survivors_total", "blendmatch_matches_total",
                     "blendmatch_verify_rejections_total", "blendmatch_engine_failovers_total",
                     "blendmatch_index_contents", "blendmatch_index_chunks", "blendmatch_index_claims",
                     "blendmatch_engine_info", "blendmatch_directory_keys"):
            assert name in text, name
        samples = metric_samples(text)
        assert samples["blendmatch_matches_total"] == 6
        assert samples['blendmatch_event_batches_total{result="applied"}'] == 1
        assert samples['blendmatch_event_batches_total{result="duplicate"}'] == 1
        assert samples["blendmatch_index_chunks"] == 2
        assert samples['blendmatch_http_rejected_total{status="422"}'] == 1
        assert samples["blendmatch_batch_queries_count"] == 4  # the bad query too: it is decoded in a batch


async def test_prefilled_directory_is_served():
    directory = KeyDirectory()
    directory.enable_blend_lookup(chunk_size=C, engine="reference")
    rows = chunks(1)
    directory.apply(events(wire_batch("i9", 1, "store", [wire_entry(hash_of(0), MODEL, token_ids=rows[0].tolist(),
                                                                    token_offset=0, size_bytes=1)])))
    async with served(directory=directory) as (client, _):
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(rows[0]), "model_name": MODEL})
        assert r.json()["matches"][0]["cur_st"] == 0
        assert (await client.get("/directory/stats")).json()["blendmatch"]["engine"]["name"] == "reference"


async def test_fast_path_and_route_answer_identically():
    """Well-formed lookups are answered by the fast path; a chunked body (no Content-Length)
    goes through the FastAPI route. Same bytes either way, for both lookup endpoints."""
    rows = chunks(3)
    async with served() as (client, _):
        await client.post("/events", json=events(store("i1", 1, rows)))
        q = query_with(rows[[2, 0]], [1, 30], 64)
        single = {"tokens_b64": b64(q), "model_name": MODEL}
        batch = {"queries": [single, {"token_ids": q.tolist(), "model_name": MODEL, "cache_salt": "x"}]}
        # odd but valid JSON: escapes, duplicate keys (the last wins), whitespace
        odd = ('{ "model_name" : "ll\\u0061ma", "world_size": 7, "world_size": 1,\n "tokens_b64": "%s" }'
               % b64(q)).encode()
        for path, body in (("/directory/blend-lookup", single), ("/directory/blend-lookup/batch", batch),
                           ("/directory/blend-lookup", odd)):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()

            async def stream(data=raw):
                yield data[:10]
                yield data[10:]

            fast = await client.post(path, content=raw, headers={"content-type": "application/json"})
            routed = await client.post(path, content=stream(), headers={"content-type": "application/json"})
            assert fast.status_code == routed.status_code == 200
            assert fast.content == routed.content
            assert fast.headers["content-type"] == routed.headers["content-type"] == "application/json"
            if body is odd:
                assert len(fast.json()["matches"]) == 2
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_lookup_latency_seconds_count{endpoint="single"}'] == 4
        assert samples['blendmatch_lookup_latency_seconds_count{endpoint="batch"}'] == 2
        r = await client.post("/directory/blend-lookup", content=json.dumps(single).encode(),
                              headers={"content-type": "text/plain"})
        assert r.status_code == 415  # not JSON by its content type: refused before any parsing


@pytest.mark.anyio
async def test_refuse_lookups_until_ready_answers_503_then_stays_open():
    """Where nothing routes by /readyz (``serve --workers``), a server still catching up
    says so (503) instead of answering from a partial index; once ready it stays open."""
    from service_support import MODEL, b64, chunks, config, events, served, store

    rows = chunks(2, seed=11)
    async with served(config(refuse_lookups_until_ready=True)) as (client, app):
        ctx = app.state.blendmatch_context
        assert (await client.post("/events", json=events(store("a", 1, rows)))).status_code == 200
        real = ctx.durability.readiness
        ctx.durability.readiness = lambda: (False, ["event log lag 5000 > --max-ready-lag 1000"])
        body = {"tokens_b64": b64(rows.ravel()), "model_name": MODEL}
        for path, payload in (("/directory/blend-lookup", body),
                              ("/directory/blend-lookup/batch", {"queries": [body]}),
                              ("/directory/lookup", {"keys": [{"chunk_hash_hex": "00ff", "model_name": MODEL,
                                                               "kv_rank": 0}]})):
            got = await client.post(path, json=payload)
            assert got.status_code == 503 and "event log lag 5000" in got.json()["detail"], (path, got.text)
        ctx.durability.readiness = real
        got = await client.post("/directory/blend-lookup", json=body)
        assert got.status_code == 200 and len(got.json()["matches"]) == 2
        ctx.durability.readiness = lambda: (False, ["event log lag unknown"])  # later lag: still answers
        assert (await client.post("/directory/blend-lookup", json=body)).status_code == 200
    async with served(config()) as (client, app):  # the default answers at once
        app.state.blendmatch_context.durability.readiness = lambda: (False, ["restoring checkpoint"])
        assert (await client.post("/directory/blend-lookup", json={"tokens_b64": "", "model_name": MODEL})).status_code == 200
