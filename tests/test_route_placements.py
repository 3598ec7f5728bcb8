"""Placement-aware matches (issue 26, part 1): ``include_placements`` on the blend lookups.

The fleet: A and B registered (live), C sends events without registering (not live), a
shared L2 pool. The default wire stays LMCache's, byte for byte: a lookup without the
options is compared with the bytes formatted independently from the directory's own
matches, through the fast path and through the routes.
"""

from __future__ import annotations

import json

import pytest

from blendmatch.index.types import BlendNamespace
from service_support import C, MODEL, b64, chunks, config, events, hash_of, served, store

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


ROWS = chunks(8, seed=26)
#: query: chunks 0..7 back to back
QUERY = ROWS.reshape(-1)


async def _fleet(client) -> None:
    for inst in ("A", "B"):
        r = await client.post("/instances", json={"instance_id": inst, "ip": "10.0.0.1", "http_port": 1})
        assert r.status_code == 200
    body = events(
        store("A", 1, ROWS[0:4], first_hash=0),                                   # A: L1 of chunks 0..3
        store("B", 1, ROWS[2:6], first_hash=2, offsets=[2 * C, 3 * C, 4 * C, 5 * C]),  # B: L1 of 2..5
        store("C", 1, ROWS[6:7], first_hash=6, offsets=[6 * C]),                   # C: not registered
        store("pool", 1, ROWS[5:6], first_hash=5, offsets=[5 * C], tier="l2", backend="mooncake",
              shared=True),                                                        # shared L2: 5 and 7
        store("pool", 2, ROWS[7:8], first_hash=7, offsets=[7 * C], tier="l2", backend="mooncake", shared=True),
        store("A", 2, ROWS[1:2], first_hash=1, offsets=[C], tier="l2", backend="disk"),  # A's own L2 of 1
    )
    r = await client.post("/events", json=body)
    assert r.status_code == 200, r.text


async def _streamed(data: bytes):
    yield data[:7]
    yield data[7:]


def _lmcache_bytes(matches) -> bytes:
    """LMCache's answer format, formatted here independently of the service's encoder."""
    return json.dumps({"matches": [{"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st}
                                   for m in matches]}, separators=(",", ":")).encode()


async def test_default_wire_is_byte_identical_through_fast_path_and_route():
    async with served() as (client, app):
        await _fleet(client)
        ctx = app.state.blendmatch_context
        expected = _lmcache_bytes(ctx.directory.blend_match(QUERY, BlendNamespace(MODEL)))
        assert expected.count(b"chunk_hash") == 8
        for body in ({"token_ids": QUERY.tolist(), "model_name": MODEL},
                     {"tokens_b64": b64(QUERY), "model_name": MODEL},
                     {"tokens_b64": b64(QUERY), "model_name": MODEL, "include_placements": False}):
            fast = await client.post("/directory/blend-lookup", json=body)
            # streamed without a Content-Length: the fast path hands it to the route
            routed = await client.post("/directory/blend-lookup", content=_streamed(json.dumps(body).encode()),
                                       headers={"content-type": "application/json"})
            assert "content-length" not in routed.request.headers
            assert fast.content == expected and routed.content == expected
        batch = await client.post("/directory/blend-lookup/batch",
                                  json={"queries": [{"tokens_b64": b64(QUERY), "model_name": MODEL}] * 2})
        assert batch.content == b'{"results":[' + expected + b"," + expected + b"]}"


def _where(match) -> list[tuple[str, str, str]]:
    return [(p["instance_id"], p["tier"], p["backend"]) for p in match["placements"]]


@pytest.mark.parametrize("form", ["token_ids", "tokens_b64"])
async def test_placements_ranked_for_the_requester_and_dead_holders_left_out(form):
    tokens = QUERY.tolist() if form == "token_ids" else b64(QUERY)
    async with served() as (client, _):
        await _fleet(client)
        r = await client.post("/directory/blend-lookup", json={form: tokens, "model_name": MODEL,
                                                               "include_placements": True,
                                                               "requester_instance_id": "B"})
        assert r.status_code == 200, r.text
        got = r.json()
        by_pos = {m["cur_st"] // C: m for m in got["matches"]}
        # chunk 6: only C holds it (in L1), and C is not registered: dropped, and said so
        assert sorted(by_pos) == [0, 1, 2, 3, 4, 5, 7] and got["dropped_without_live_holder"] == 1
        assert _where(by_pos[0]) == [("A", "l1", "LocalCPUBackend")]
        assert _where(by_pos[1]) == [("A", "l1", "LocalCPUBackend"), ("A", "l2", "disk")]
        # the requester's own L1 first, then the other live instance's
        assert _where(by_pos[2]) == [("B", "l1", "LocalCPUBackend"), ("A", "l1", "LocalCPUBackend")]
        assert _where(by_pos[5]) == [("B", "l1", "LocalCPUBackend"), ("", "l2", "mooncake")]
        assert _where(by_pos[7]) == [("", "l2", "mooncake")]
        assert by_pos[3]["chunk_hash"] == hash_of(3).hex() and by_pos[3]["old_st"] == 3 * C

        # C registers: its copy counts; B leaves: its L1 is fenced (chunk 4 is gone)
        assert (await client.post("/instances", json={"instance_id": "C", "ip": "10.0.0.3", "http_port": 1})
                ).status_code == 200
        assert (await client.delete("/instances/B")).status_code == 204
        r = await client.post("/directory/blend-lookup", json={form: tokens, "model_name": MODEL,
                                                               "include_placements": True})
        got = r.json()
        by_pos = {m["cur_st"] // C: m for m in got["matches"]}
        assert sorted(by_pos) == [0, 1, 2, 3, 5, 6, 7] and got["dropped_without_live_holder"] == 0
        assert _where(by_pos[6]) == [("C", "l1", "LocalCPUBackend")]
        assert _where(by_pos[2]) == [("A", "l1", "LocalCPUBackend")]
        assert _where(by_pos[5]) == [("", "l2", "mooncake")]


async def test_batch_mixes_placed_and_plain_queries_and_other_namespaces_see_nothing():
    async with served() as (client, _):
        await _fleet(client)
        plain = (await client.post("/directory/blend-lookup",
                                   json={"tokens_b64": b64(QUERY), "model_name": MODEL})).content
        r = await client.post("/directory/blend-lookup/batch", json={"queries": [
            {"tokens_b64": b64(QUERY), "model_name": MODEL},
            {"tokens_b64": b64(QUERY), "model_name": MODEL, "include_placements": True, "requester_instance_id": "A"},
            {"tokens_b64": b64(QUERY), "model_name": "other", "include_placements": True},
        ]})
        assert r.status_code == 200, r.text
        assert r.content.startswith(b'{"results":[' + plain + b",")
        results = r.json()["results"]
        assert len(results[1]["matches"]) == 7 and results[1]["dropped_without_live_holder"] == 1
        assert _where(results[1]["matches"][1])[0] == ("A", "l1", "LocalCPUBackend")
        assert results[2] == {"matches": [], "dropped_without_live_holder": 0, "placements_truncated": False}


async def test_bad_options_are_a_422_naming_the_field():
    async with served() as (client, _):
        for body, field in (({"include_placements": "yes"}, "include_placements"),
                            ({"include_placements": True, "requester_instance_id": 3}, "requester_instance_id")):
            r = await client.post("/directory/blend-lookup",
                                  json={"token_ids": [1, 2], "model_name": MODEL, **body})
            assert r.status_code == 422 and field in r.text


async def test_placements_with_blend_lookup_disabled():
    async with served(config(enable_blend_lookup=False)) as (client, _):
        r = await client.post("/directory/blend-lookup", json={"token_ids": [1, 2], "model_name": MODEL,
                                                               "include_placements": True})
        assert r.status_code == 200 and r.json() == {"matches": [], "dropped_without_live_holder": 0,
                                                     "placements_truncated": False}
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": "!!", "model_name": MODEL,
                                                               "include_placements": True})
        assert r.status_code == 422 and "tokens_b64" in r.text


def test_client_parses_placements_and_prefers_the_better_placed_overlap():
    from blendmatch.service.client import MatchPlacement, PlacedMatch, _matches, resolve_overlaps

    payload = {"matches": [
        {"chunk_hash": "aa", "old_st": 0, "cur_st": 0, "placements": [{"instance_id": "", "tier": "l2", "backend": "m"}]},
        {"chunk_hash": "bb", "old_st": 0, "cur_st": 8, "placements": [{"instance_id": "B", "tier": "l1", "backend": "c"}]},
        {"chunk_hash": "cc", "old_st": 0, "cur_st": 16, "placements": [{"instance_id": "A", "tier": "l1", "backend": "c"}]},
    ], "dropped_without_live_holder": 0}
    got = _matches(payload)
    assert got[1] == PlacedMatch(b"\xbb", 0, 8, (MatchPlacement("B", "l1", "c"),))
    # default: leftmost first (0 and 16); preferring placement for B: B's own L1 at 8 wins
    assert [m.cur_st for m in resolve_overlaps(got, 16)] == [0, 16]
    assert [m.cur_st for m in resolve_overlaps(got, 16, prefer_placement=True, requester_instance_id="B")] == [8]
    # for A: its own L1 at 16 first, then the shared copy at 0 still fits
    assert [m.cur_st for m in resolve_overlaps(got, 16, prefer_placement=True, requester_instance_id="A")] == [0, 16]


def test_lock_free_placement_reads_race_ingest_without_tearing():
    """``namespace_placements`` takes no lock (the lookup thread must not wait for ingest):
    while another thread stores, re-places and deletes the same keys, every read is one of
    the states a key passes through, never a torn or foreign one."""
    import threading

    from blendmatch.index.key_directory import KeyDirectory
    from blendmatch.index.types import pack_kv_rank
    from blendmatch.index.wire_models import wire_batch, wire_entry

    d = KeyDirectory()
    hashes = [hash_of(i) for i in range(32)]
    entries = [wire_entry(h, MODEL, pack_kv_rank(1), size_bytes=8) for h in hashes]
    other = [wire_entry(h, "other-model", pack_kv_rank(1), size_bytes=8) for h in hashes]
    stop = threading.Event()
    errors: list[BaseException] = []

    def ingest() -> None:
        seq = 0
        try:
            while not stop.is_set():
                for inst, tier, kind, ents in (("A", "l1", "store", entries), ("B", "l2", "store", entries),
                                               ("A", "l1", "store", other), ("A", "l1", "delete", entries),
                                               ("B", "l2", "delete", entries)):
                    seq += 1
                    d.apply({"batches": [wire_batch(inst, seq, kind, ents, tier=tier)]})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    allowed = {(), (("A", "l1"),), (("B", "l2"),), (("A", "l1"), ("B", "l2"))}
    t = threading.Thread(target=ingest)
    t.start()
    try:
        seen = set()
        for _ in range(3000):
            for pls in d.namespace_placements(hashes, BlendNamespace(MODEL)):
                got = tuple(sorted((p.instance_id, p.tier) for p in pls))
                assert got in allowed, got
                seen.add(got)
    finally:
        stop.set()
        t.join()
    assert not errors and len(seen) >= 2


async def test_async_client_options_against_the_app():
    import httpx

    from blendmatch.service.client import AsyncBlendClient, BlendMatch, MatchPlacement, PlacedMatch

    async with served() as (client, app):
        await _fleet(client)
        ns = BlendNamespace(MODEL)
        async with AsyncBlendClient("http://test", transport=httpx.ASGITransport(app=app)) as c:
            plain = await c.lookup(QUERY, MODEL)
            assert plain and all(type(m) is BlendMatch for m in plain)
            placed = await c.lookup(QUERY, MODEL, include_placements=True, requester_instance_id="B")
            assert all(type(m) is PlacedMatch for m in placed) and len(placed) == len(plain) - 1  # chunk 6 dropped
            assert placed[2].placements[0] == MatchPlacement("B", "l1", "LocalCPUBackend")
            assert [tuple(m[:3]) for m in placed] == [tuple(m) for m in plain if m.cur_st != 6 * C]
            (batch,) = await c.lookup_batch([(QUERY, ns)], include_placements=True, requester_instance_id="B")
            assert batch == placed
            score = await c.route_score(QUERY, MODEL, candidates=["A", "B"])
            assert [r["instance_id"] for r in score["instances"]] == ["A", "B"]
            assert score["instances"][0]["reusable_tokens"] == 4 * C  # A: chunks 0..3 in L1 (hashes not chained)
