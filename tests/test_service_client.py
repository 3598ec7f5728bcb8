"""BlendClient / AsyncBlendClient without a server (ASGI and mock transports) and
resolve_overlaps."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from blendmatch.index.types import BlendMatch, BlendNamespace
from blendmatch.service.client import (
    AsyncBlendClient,
    BlendClient,
    BlendConnectionError,
    BlendHTTPError,
    resolve_overlaps,
)
from service_support import C, MODEL, chunks, config, events, hash_of, served, store

pytestmark = pytest.mark.anyio


def _batch_counts(reply: dict) -> dict:
    """LMCache's three batch counts of a POST /events reply (ours add per-entry fields)."""
    return {k: reply[k] for k in ("applied", "duplicates", "stale")}


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ---------------------------------------------------------------------- resolve_overlaps
def m(cur: int, tag: int = 0) -> BlendMatch:
    return BlendMatch(bytes([tag]), 0, cur)


def test_resolve_overlaps_leftmost_greedy():
    got = resolve_overlaps([m(0), m(100), m(256), m(300), m(511), m(512)], chunk_size=256)
    assert [x.cur_st for x in got] == [0, 256, 512]


def test_resolve_overlaps_ties_keep_server_order_and_input_may_be_unsorted():
    got = resolve_overlaps([m(300, 3), m(10, 1), m(10, 2), m(265, 4)], chunk_size=256)
    assert [(x.cur_st, x.chunk_hash) for x in got] == [(10, b"\x01"), (300, b"\x03")]


def test_resolve_overlaps_is_maximal_on_random_inputs():
    rng = np.random.default_rng(3)
    for _ in range(200):
        starts = sorted(rng.integers(0, 200, size=rng.integers(0, 12)).tolist())
        got = resolve_overlaps([m(s) for s in starts], chunk_size=16)
        cur = [x.cur_st for x in got]
        assert all(b - a >= 16 for a, b in zip(cur, cur[1:], strict=False))
        # brute force: no non-overlapping subset is larger
        best = 0
        for mask in range(1 << len(starts)):
            pick = [s for i, s in enumerate(starts) if mask >> i & 1]
            if all(b - a >= 16 for a, b in zip(pick, pick[1:], strict=False)):
                best = max(best, len(pick))
        assert len(got) == best


def test_resolve_overlaps_edge_cases():
    assert resolve_overlaps([]) == []
    with pytest.raises(ValueError, match="chunk_size"):
        resolve_overlaps([m(0)], chunk_size=0)


# ---------------------------------------------------------------------- clients
async def test_async_client_against_the_app_in_process():
    rows = chunks(3)
    async with served() as (_, app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncBlendClient("http://test", transport=transport) as client:
            assert await client.healthz()
            assert _batch_counts(await client.post_events([store("i1", 1, rows)])) == {"applied": 1, "duplicates": 0, "stale": 0}
            q = np.concatenate([rows[2], rows[0]])
            got = await client.lookup(q, MODEL)
            assert got == [BlendMatch(hash_of(2), 2 * C, 0), BlendMatch(hash_of(0), 0, C)]
            assert await client.lookup(q, BlendNamespace(MODEL, "other", 1)) == []
            batch = await client.lookup_batch([(q, BlendNamespace(MODEL)), (rows[1], BlendNamespace(MODEL))])
            assert batch == [got, [BlendMatch(hash_of(1), C, 0)]]
            assert (await client.stats())["num_keys"] == 3
            await client.deregister_instance("i1")
            assert (await client.stats())["num_keys"] == 0
            with pytest.raises(BlendHTTPError) as ei:
                await client.lookup([1, 2], "")
            assert ei.value.status_code == 422 and "model_name" in ei.value.detail


def test_sync_client_with_a_mock_transport():
    seen: list[tuple[str, str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append((request.method, request.url.path, body))
        if request.url.path == "/directory/blend-lookup":
            return httpx.Response(200, json={"matches": [{"chunk_hash": "0a0b", "old_st": 256, "cur_st": 3}]})
        if request.url.path == "/directory/blend-lookup/batch":
            return httpx.Response(200, json={"results": [{"matches": []}] * len(body["queries"])})
        if request.url.path == "/events":
            return httpx.Response(413, json={"detail": "too big"})
        return httpx.Response(204)

    with BlendClient("http://mock", transport=httpx.MockTransport(handler)) as client:
        assert client.lookup(np.array([1, 2], dtype=np.uint32), "m", world_size=2, cache_salt="s") == [
            BlendMatch(b"\x0a\x0b", 256, 3)]
        method, path, body = seen[-1]
        assert body == {"tokens_b64": "AQAAAAIAAAA=", "model_name": "m", "world_size": 2, "cache_salt": "s"}
        assert client.lookup_batch([([1], BlendNamespace("m")), ([2], BlendNamespace("n"))]) == [[], []]
        with pytest.raises(BlendHTTPError, match="413: too big"):
            client.post_events({"batches": []})
        client.deregister_instance("a/b c")
        assert seen[-1][:2] == ("DELETE", "/instances/a%2Fb%20c") or seen[-1][1] == "/instances/a/b c"


def test_sync_client_connection_error():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with BlendClient("http://mock", transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(BlendConnectionError, match="ConnectError"):
            client.healthz()


def test_config_rejects_bad_values():
    from pydantic import ValidationError

    for bad in ({"max_batch_tokens": 0}, {"port": 70000}, {"engine": "tpu"}, {"chunk_size": 0},
                {"max_batch_wait_ms": -1}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            config(**bad)
    assert config().max_body_bytes == 1_000_000 * 16 + (1 << 20)
    assert config(max_body_bytes=4096).max_body_bytes == 4096


def test_events_helper_shape():
    body = events(store("i", 1, chunks(1)))
    assert body["batches"][0]["entries"][0]["key"]["model_name"] == MODEL
