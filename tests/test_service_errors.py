"""Bad input: always a 4xx with a JSON ``detail`` naming the problem; never a 500, never a
partial apply, and the server keeps serving."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from service_support import MODEL, b64, chunks, config, events, served, store

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


OK_TOKENS = b64(np.arange(40))

# (case id, path, raw body or JSON-able object, expected status, substring of detail)
LOOKUP_CASES = [
    ("malformed-json", "/directory/blend-lookup", b'{"tokens_b64": "AAAA", ', 422, "JSON decode error"),
    ("not-an-object", "/directory/blend-lookup", b"[1, 2]", 422, "body"),
    ("empty-body", "/directory/blend-lookup", b"", 422, "body"),
    ("missing-model", "/directory/blend-lookup", {"tokens_b64": OK_TOKENS}, 422, "body.model_name: Field required"),
    ("empty-model", "/directory/blend-lookup", {"tokens_b64": OK_TOKENS, "model_name": ""}, 422, "model_name"),
    ("model-not-str", "/directory/blend-lookup", {"tokens_b64": OK_TOKENS, "model_name": 7}, 422, "model_name"),
    ("world-size-0", "/directory/blend-lookup", {"tokens_b64": OK_TOKENS, "model_name": MODEL, "world_size": 0},
     422, "body.world_size: Input should be greater than or equal to 1, got 0"),
    ("world-size-str", "/directory/blend-lookup", {"tokens_b64": OK_TOKENS, "model_name": MODEL, "world_size": "2"},
     422, "world_size"),
    ("salt-not-str", "/directory/blend-lookup", {"tokens_b64": OK_TOKENS, "model_name": MODEL, "cache_salt": 1},
     422, "cache_salt"),
    ("bad-base64", "/directory/blend-lookup", {"tokens_b64": "AAA*", "model_name": MODEL}, 422,
     "tokens_b64: not valid standard base64"),
    ("b64-not-mult-4", "/directory/blend-lookup", {"tokens_b64": base64.b64encode(b"12345").decode(),
                                                   "model_name": MODEL}, 422, "not a multiple of 4"),
    ("b64-not-str", "/directory/blend-lookup", {"tokens_b64": [1, 2], "model_name": MODEL}, 422, "tokens_b64"),
    ("negative-id", "/directory/blend-lookup", {"token_ids": [1, -5], "model_name": MODEL}, 422, "got -5"),
    ("id-2^32", "/directory/blend-lookup", {"token_ids": [2**32], "model_name": MODEL}, 422, "got 4294967296"),
    ("id-huge", "/directory/blend-lookup", {"token_ids": [2**80], "model_name": MODEL}, 422, "token_ids"),
    ("id-bool", "/directory/blend-lookup", {"token_ids": [1, True], "model_name": MODEL}, 422, "token_ids.1"),
    ("id-float", "/directory/blend-lookup", {"token_ids": [1.5], "model_name": MODEL}, 422, "token_ids.0"),
    ("ids-not-list", "/directory/blend-lookup", {"token_ids": "1 2", "model_name": MODEL}, 422, "token_ids"),
    ("both-forms", "/directory/blend-lookup", {"token_ids": [1], "tokens_b64": OK_TOKENS, "model_name": MODEL},
     422, "exactly one"),
    ("neither-form", "/directory/blend-lookup", {"model_name": MODEL}, 422, "exactly one"),
    ("batch-missing", "/directory/blend-lookup/batch", {}, 422, "body.queries: Field required"),
    ("batch-bad-item", "/directory/blend-lookup/batch",
     {"queries": [{"tokens_b64": OK_TOKENS, "model_name": MODEL}, {"token_ids": [-1], "model_name": MODEL}]},
     422, "body.queries.1"),
    ("batch-not-list", "/directory/blend-lookup/batch", {"queries": {"a": 1}}, 422, "queries"),
    # /directory/lookup: LMCache's rules (both or neither form: 422, an empty list counts as absent)
    ("lookup-no-keys", "/directory/lookup", {}, 422, "exactly one of 'keys' or 'token_ids'"),
    ("lookup-empty-lists", "/directory/lookup", {"keys": [], "token_ids": []}, 422, "exactly one"),
    ("lookup-both-forms", "/directory/lookup", {"keys": [{"chunk_hash_hex": "ab", "model_name": MODEL, "kv_rank": 1}], "token_ids": [1], "model_name": MODEL},
     422, "exactly one"),
    ("lookup-tokens-no-model", "/directory/lookup", {"token_ids": [1, 2]}, 422, "model_name"),
    ("lookup-world-size-0", "/directory/lookup", {"token_ids": [1], "model_name": MODEL, "world_size": 0},
     422, "world_size"),
    ("lookup-too-many-tokens", "/directory/lookup", {"token_ids": [1] * 1_000_001, "model_name": MODEL},
     400, "over the limit of 1000000"),
    ("lookup-tokens-bad-salt", "/directory/lookup", {"token_ids": [1, 2], "model_name": MODEL, "cache_salt": "a/b"},
     400, "cache_salt must not contain"),
    ("lookup-tokens-model-at", "/directory/lookup", {"token_ids": list(range(256)), "model_name": "a@b"},
     400, "model_name must not contain '@'"),
    ("lookup-tokens-huge-world", "/directory/lookup", {"token_ids": list(range(256)), "model_name": MODEL,
                                                       "world_size": 1 << 19}, 400, "keys, more than 262144"),
    ("lookup-bad-hex", "/directory/lookup",
     {"keys": [{"chunk_hash_hex": "zz", "model_name": MODEL, "kv_rank": 1}]}, 422, "chunk_hash_hex"),
    ("events-malformed", "/events", b'{"batches": [', 422, "JSON decode error"),
    ("events-not-utf8", "/events", b'\xff\xfe{"batches": []}', 422, "JSON decode error"),
    ("events-empty", "/events", b"", 422, "body: Field required"),
    ("events-no-batches", "/events", {"batch": []}, 422, "batches"),
    ("events-bad-tier", "/events", {"batches": [{"instance_id": "i", "incarnation": 0, "seq": 1,
                                                 "event_type": "store", "tier": "all", "backend": "b"}]},
     422, "body.batches.0.tier: must be one of l1, l2"),
]


@pytest.mark.parametrize("case, path, body, status, needle", LOOKUP_CASES, ids=[c[0] for c in LOOKUP_CASES])
async def test_bad_input_is_a_4xx_naming_the_problem(case, path, body, status, needle):
    async with served() as (client, _):
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
        assert r.status_code == status, r.text
        detail = r.json()["detail"]
        assert isinstance(detail, str) and needle in detail, detail
        # and the server keeps serving
        assert (await client.get("/healthz")).status_code == 200
        ok = await client.post("/directory/blend-lookup", json={"tokens_b64": OK_TOKENS, "model_name": MODEL})
        assert ok.status_code == 200


async def test_query_params_are_validated():
    async with served() as (client, _):
        for params, needle in (({"limit": 0}, "limit"), ({"offset": -1}, "offset"), ({"tier": "l3"}, "tier"),
                               ({"limit": "x"}, "limit")):
            r = await client.get("/directory/keys", params=params)
            assert r.status_code == 422 and needle in r.json()["detail"], r.text
        r = await client.get("/nope")
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        r = await client.get("/events")
        assert r.status_code == 405


async def test_invalid_event_batch_rejects_the_whole_request():
    rows = chunks(3)
    good = store("i1", 1, rows[:2])
    bad = store("i2", 1, rows[2:], first_hash=2)
    bad["entries"][0]["key"]["kv_rank"] = -1
    async with served() as (client, _):
        r = await client.post("/events", json=events(good, bad))
        assert r.status_code == 422
        assert r.json()["detail"].startswith("body.batches.1.entries.0.key.kv_rank: must be in")
        stats = (await client.get("/directory/stats")).json()
        assert stats["num_keys"] == 0 and stats["blend"]["num_chunks"] == 0  # nothing of it applied
        assert stats["blendmatch"]["instances"] == {}
        # the same good batch alone is then applied as new (the gate never saw it)
        assert (await client.post("/events", json=events(good))).json()["applied"] == 1


async def test_token_limit_is_413():
    async with served(config(max_request_tokens=100)) as (client, _):
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(np.arange(101)), "model_name": MODEL})
        detail = r.json()["detail"]
        assert r.status_code == 413 and "101 tokens" in detail and "--max-request-tokens" in detail
        ok = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(np.arange(100)), "model_name": MODEL})
        assert ok.status_code == 200
        r = await client.post("/directory/blend-lookup/batch", json={"queries": [
            {"tokens_b64": b64(np.arange(60)), "model_name": MODEL}] * 2})
        assert r.status_code == 413 and "120 tokens" in r.json()["detail"]


async def test_oversized_body_is_413_before_parsing():
    cfg = config(max_body_bytes=4096)
    async with served(cfg) as (client, _):
        big = {"tokens_b64": b64(np.arange(2000)), "model_name": MODEL}
        r = await client.post("/directory/blend-lookup", json=big)
        assert r.status_code == 413 and "4096" in r.json()["detail"]
        # invalid JSON that is too big: the limit answers first (nothing is parsed)
        r = await client.post("/events", content=b"{" * 5000)
        assert r.status_code == 413

        async def chunked():  # no Content-Length: the streamed bytes are counted
            for _ in range(10):
                yield b"x" * 1000
        r = await client.post("/events", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["detail"]
        r = await client.post("/events", content=b'{"batches": []}', headers={"content-length": "abc"})
        assert r.status_code == 400
        assert (await client.get("/healthz")).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'blendmatch_http_rejected_total{status="413"} 3.0' in metrics


async def test_unexpected_error_is_a_json_500_and_counted(monkeypatch):
    async with served() as (client, app):
        ctx = app.state.blendmatch_context

        def broken():
            raise RuntimeError("boom")

        monkeypatch.setattr(ctx, "stats", broken)
        r = await client.get("/directory/stats")
        assert r.status_code == 500 and "RuntimeError" in r.json()["detail"]
        assert "blendmatch_http_internal_errors_total 1.0" in (await client.get("/metrics")).text
        assert (await client.get("/healthz")).status_code == 200


async def test_engine_failure_reaches_every_request_then_service_recovers(monkeypatch):
    rows = chunks(1)
    async with served() as (client, app):
        await client.post("/events", json=events(store("i1", 1, rows)))
        index = app.state.blendmatch_context.directory.blend_index
        real = index.match_flat  # what the lookup thread calls
        calls = {"n": 0}

        def flaky(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("device lost")
            return real(*args)

        monkeypatch.setattr(index, "match_flat", flaky)
        body = {"tokens_b64": b64(rows[0]), "model_name": MODEL}
        r = await client.post("/directory/blend-lookup", json=body)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        r = await client.post("/directory/blend-lookup", json=body)
        assert r.status_code == 200 and len(r.json()["matches"]) == 1


def test_error_detail_never_echoes_the_whole_body():
    from blendmatch.service.handlers import format_validation_errors

    detail, errors = format_validation_errors([{"type": "string_type", "loc": ("body", "model_name"),
                                                "msg": "Input should be a valid string", "input": "x" * 10_000}])
    assert len(detail) < 200 and "..." in detail
    assert all("input" not in e for e in errors)
    json.dumps(errors)  # serialisable

