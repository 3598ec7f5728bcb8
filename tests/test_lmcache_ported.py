"""LMCache 0.5.6's own tests of the coordinator's ``/directory`` API
(``tests/v1/mp_coordinator/test_directory_api.py``) and of its blend client
(``test_blend_client.py``), ported to run against blendmatch: same requests, same assertions.

What changed in the port, and only that:

- ``create_app(MPCoordinatorConfig(...))`` is blendmatch's ``create_app(ServiceConfig(...))``
  with LMCache's defaults (chunk size 256; blend lookup off for ``_client()``, on for
  ``_blend_client()``), and the test client is a loopback peer (blendmatch serves only
  loopback peers without an access file).
- The two places that reach into LMCache's internals (``app.state.ctx.views.get(KeyDirectory)``,
  ``directory.consume(CacheEventBatch(...))``) use blendmatch's directory instead
  (``get_token_ids``, ``apply`` with the same batch as wire JSON).
- ``POST /events`` replies carry our extra fields (docs/lmcache.md): compared on LMCache's
  three.
- The blend client is ours (``BlendCoordinatorClient`` from ``blendmatch.service.client``),
  driven through LMCache's ``request_fn`` hook exactly as LMCache's test drives its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.tokens import decode_b64, encode_tokens
from blendmatch.index.types import BlendNamespace, pack_kv_rank
from blendmatch.service.app import create_app
from blendmatch.service.client import PENDING, BlendCoordinatorClient
from blendmatch.service.config import ServiceConfig

LMCACHE_CHUNK_SIZE = 256  # MPCoordinatorConfig().chunk_size
LMCACHE_REPLY = ("applied", "duplicates", "stale")


def _config(**kw) -> ServiceConfig:
    return ServiceConfig(host="127.0.0.1", engine="cpu", health_check_interval=0, chunk_size=LMCACHE_CHUNK_SIZE, **kw)


def _client() -> TestClient:
    # a loopback peer: blendmatch serves only loopback without an access file (protected mode)
    return TestClient(create_app(_config(enable_blend_lookup=False)), client=("127.0.0.1", 50000))


def _blend_client() -> TestClient:
    """A coordinator with fragment (blend) lookup turned on."""
    return TestClient(create_app(_config(enable_blend_lookup=True)), client=("127.0.0.1", 50000))


MODEL = "m"
WORLD_SIZE = 1


def _key(h: str = "aa", model: str = MODEL, rank: int = 0, salt: str = "", world_size: int = WORLD_SIZE) -> dict:
    """A key shaped the way a server emits one -- ``kv_rank`` packs the parallel setup."""
    return {"chunk_hash_hex": h, "model_name": model,
            "kv_rank": pack_kv_rank(world_size, rank, world_size, rank), "cache_salt": salt}


def _batch(instance_id: str = "node-a", incarnation: int = 1, seq: int = 1, event_type: str = "store",
           tier: str = "l1", backend: str = "dram", entries: list[dict] | None = None) -> dict:
    if entries is None:
        entries = [{"key": _key(), "size_bytes": 1024}]
    return {"instance_id": instance_id, "incarnation": incarnation, "seq": seq, "event_type": event_type,
            "tier": tier, "backend": backend, "entries": entries}


def _post_events(client: TestClient, batches: list[dict]) -> dict:
    resp = client.post("/events", json={"batches": batches})
    assert resp.status_code == 200
    return {name: resp.json()[name] for name in LMCACHE_REPLY}


def _lookup(client: TestClient, keys: list[dict]) -> dict:
    resp = client.post("/directory/lookup", json={"keys": keys})
    assert resp.status_code == 200
    return resp.json()


# -- Events + lookup ---------------------------------------------------------


def test_store_events_then_lookup():
    with _client() as client:
        data = _post_events(client, [_batch()])
        assert data == {"applied": 1, "duplicates": 0, "stale": 0}

        result = _lookup(client, [_key()])["results"]
        assert len(result) == 1
        assert result[0]["key"]["chunk_hash_hex"] == "aa"
        [placement] = result[0]["placements"]
        assert placement["instance_id"] == "node-a"
        assert placement["incarnation"] == 1
        assert placement["tier"] == "l1"
        assert placement["backend"] == "dram"
        assert placement["size_bytes"] == 1024


def test_lookup_unknown_key_returns_empty_placements():
    with _client() as client:
        result = _lookup(client, [_key(h="ff")])["results"]
        assert result[0]["key"]["chunk_hash_hex"] == "ff"
        assert result[0]["placements"] == []


def test_delete_event_removes_placement():
    with _client() as client:
        _post_events(client, [_batch(seq=1)])
        _post_events(client, [_batch(seq=2, event_type="delete", entries=[{"key": _key()}])])
        result = _lookup(client, [_key()])["results"]
        assert result[0]["placements"] == []


def test_duplicate_and_stale_batches_are_counted():
    with _client() as client:
        _post_events(client, [_batch(incarnation=2, seq=1)])
        data = _post_events(client, [
            _batch(incarnation=2, seq=1),  # replay -> duplicate
            _batch(incarnation=1, seq=9),  # pre-restart -> stale
            _batch(incarnation=2, seq=2),  # fresh -> applied
        ])
        assert data == {"applied": 1, "duplicates": 1, "stale": 1}


# -- Token -> placement lookup -------------------------------------------------


def _lookup_tokens_body(n_tokens: int, model: str = "m") -> dict:
    return {"model_name": model, "world_size": 1, "token_ids": list(range(n_tokens)), "cache_salt": ""}


def test_lookup_tokens_short_sequence_resolves_no_chunks():
    with _client() as client:
        resp = client.post("/directory/lookup", json=_lookup_tokens_body(10))
        assert resp.status_code == 200
        assert resp.json() == {"chunks": 0, "results": []}


def test_lookup_tokens_roundtrip():
    with _client() as client:
        # Resolve one full chunk; nothing stored yet -> empty placements.
        first = client.post("/directory/lookup", json=_lookup_tokens_body(256)).json()
        assert first["chunks"] == 1
        assert len(first["results"]) == 1
        assert first["results"][0]["placements"] == []

        # Store the exact key the resolution produced, then look up again.
        key = first["results"][0]["key"]
        _post_events(client, [_batch(entries=[{"key": key, "size_bytes": 64}])])

        second = client.post("/directory/lookup", json=_lookup_tokens_body(256)).json()
        [placement] = second["results"][0]["placements"]
        assert placement["instance_id"] == "node-a"
        assert placement["size_bytes"] == 64


def test_lookup_tokens_invalid_model_name_is_400():
    with _client() as client:
        resp = client.post("/directory/lookup", json=_lookup_tokens_body(256, model="a@b"))
        assert resp.status_code == 400


# -- Stats -------------------------------------------------------------------


def test_stats_reports_counts_and_per_instance_l1_keys():
    """Directory contents only — per-emitter stream state (incarnation, seq, gap flag) lives
    on the ingest gate and is not exposed here."""
    with _client() as client:
        _post_events(client, [_batch(seq=1)])
        _post_events(client, [_batch(seq=5, entries=[{"key": _key(h="bb")}])])
        _post_events(client, [_batch(seq=6, tier="l2", backend="fs", entries=[{"key": _key(h="bb")}])])

        data = client.get("/directory/stats").json()
        assert data["num_keys"] == 2
        assert data["num_placements"] == 3
        # Both keys got an L1 placement from node-a; the third batch added an L2 placement,
        # which the L1 index does not count.
        assert data["l1_keys_by_instance"]["node-a"] == 2
        assert "instances" not in data


# -- Token bindings ----------------------------------------------------------


def test_store_entry_with_tokens_populates_bindings():
    with _client() as client:
        entry = {"key": _key(), "size_bytes": 1024, "token_ids": [1, 2, 3], "token_offset": 256}
        data = _post_events(client, [_batch(entries=[entry])])
        assert data == {"applied": 1, "duplicates": 0, "stale": 0}

        # ported: LMCache reads its KeyDirectory view; this is blendmatch's directory
        key_directory: KeyDirectory = client.app.state.blendmatch_context.directory
        assert [t.tolist() for t in key_directory.get_token_ids([bytes.fromhex("aa")])] == [[1, 2, 3]]


def test_lookup_returns_the_chunks_token_ids():
    """The normal lookup reports content only — positions are the blend lookup's concern."""
    with _client() as client:
        entry = {"key": _key(), "size_bytes": 1024, "token_ids": [1, 2, 3]}
        _post_events(client, [_batch(entries=[entry])])

        resp = client.post("/directory/lookup", json={"keys": [_key()]})
        assert resp.status_code == 200
        [result] = resp.json()["results"]
        assert result["token_ids"] == [1, 2, 3]
        assert "token_offset" not in result


# -- Blend (fragment) lookup ---------------------------------------------------


def _chunk_tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def _blend_lookup(client: TestClient, tokens: list[int], model: str = MODEL, salt: str = "",
                  world_size: int = WORLD_SIZE) -> dict:
    resp = client.post("/directory/blend-lookup", json={"token_ids": tokens, "model_name": model,
                                                        "cache_salt": salt, "world_size": world_size})
    assert resp.status_code == 200
    return resp.json()


def test_blend_lookup_finds_a_stored_chunk_mid_query():
    """The fragment form does not require a prefix: content is found at whatever offset it
    sits at in the query."""
    content = _chunk_tokens(1000, LMCACHE_CHUNK_SIZE)
    with _blend_client() as client:
        entry = {"key": _key(), "size_bytes": 1024, "token_ids": content, "token_offset": 512}
        _post_events(client, [_batch(entries=[entry])])

        data = _blend_lookup(client, [7, 8, 9] + content + [11, 12])

        assert data["matches"] == [{"chunk_hash": "aa", "old_st": 512, "cur_st": 3}]


def test_blend_lookup_without_a_match_is_empty():
    with _blend_client() as client:
        data = _blend_lookup(client, _chunk_tokens(1, LMCACHE_CHUNK_SIZE + 5))
        assert data["matches"] == []


def test_blend_lookup_rejects_a_query_missing_its_identity():
    """The tokens form of ``/directory/lookup`` needs a model to resolve keys with; the
    fragment form needs the same one to scope matches."""
    with _blend_client() as client:
        resp = client.post("/directory/blend-lookup", json={"token_ids": [1, 2, 3]})
        assert resp.status_code == 422

        resp = client.post("/directory/blend-lookup", json={"model_name": MODEL})
        assert resp.status_code == 422


def test_blend_lookup_does_not_match_across_namespaces():
    """The chunk was stored by another model, so its hash expands into keys this caller has
    nothing under -- offering it would only buy a confirmed miss."""
    content = _chunk_tokens(1000, LMCACHE_CHUNK_SIZE)
    with _blend_client() as client:
        entry = {"key": _key(model="other"), "size_bytes": 1024, "token_ids": content, "token_offset": 0}
        _post_events(client, [_batch(entries=[entry])])

        assert _blend_lookup(client, content)["matches"] == []
        assert _blend_lookup(client, content, model="other")["matches"]


def test_blend_lookup_stops_matching_a_deleted_chunk():
    content = _chunk_tokens(1000, LMCACHE_CHUNK_SIZE)
    with _blend_client() as client:
        entry = {"key": _key(), "size_bytes": 1024, "token_ids": content, "token_offset": 0}
        _post_events(client, [_batch(seq=1, entries=[entry])])
        assert _blend_lookup(client, content)["matches"]

        _post_events(client, [_batch(seq=2, event_type="delete", entries=[{"key": _key()}])])
        assert _blend_lookup(client, content)["matches"] == []


# -- Listing + token ids -------------------------------------------------------


def test_list_keys_endpoint_filters_and_paginates():
    with _client() as client:
        _post_events(client, [
            _batch(seq=1, entries=[{"key": _key(h="aa"), "size_bytes": 1, "token_ids": [1, 2]},
                                   {"key": _key(h="bb"), "size_bytes": 2}]),
            _batch(seq=2, tier="l2", backend="fs", entries=[{"key": _key(h="aa")}]),
        ])

        data = client.get("/directory/keys").json()
        assert data["total"] == 2
        by_hash = {row["key"]["chunk_hash_hex"]: row for row in data["keys"]}
        assert by_hash["aa"]["num_tokens"] == 2
        assert len(by_hash["aa"]["placements"]) == 2
        assert by_hash["bb"]["num_tokens"] == 0

        l2 = client.get("/directory/keys", params={"tier": "l2"}).json()
        assert l2["total"] == 1
        assert [p["backend"] for p in l2["keys"][0]["placements"]] == ["fs"]

        page = client.get("/directory/keys", params={"offset": 1, "limit": 1}).json()
        assert page["total"] == 2
        assert len(page["keys"]) == 1

        assert client.get("/directory/keys", params={"offset": -1}).status_code == 422


def test_lookup_keys_form_returns_placements_and_tokens():
    with _client() as client:
        entry = {"key": _key(h="aa"), "size_bytes": 1, "token_ids": [1, 2, 3]}
        _post_events(client, [_batch(entries=[entry])])

        resp = client.post("/directory/lookup", json={"keys": [_key(h="aa"), _key(h="ff")]})
        assert resp.status_code == 200
        body = resp.json()
        assert body["chunks"] == 2
        results = body["results"]
        assert results[0]["token_ids"] == [1, 2, 3]
        assert len(results[0]["placements"]) == 1
        assert results[1]["token_ids"] == []  # unknown chunk
        assert results[1]["placements"] == []


def test_lookup_malformed_key_is_rejected():
    with _client() as client:
        resp = client.post("/directory/lookup", json={"keys": [_key(h="zz")]})
        assert resp.status_code == 422


def test_lookup_requires_exactly_one_form():
    with _client() as client:
        both = client.post("/directory/lookup", json={"keys": [_key()], "token_ids": [1, 2], "model_name": "m"})
        assert both.status_code == 422
        neither = client.post("/directory/lookup", json={})
        assert neither.status_code == 422
        no_model = client.post("/directory/lookup", json={"token_ids": [1, 2]})
        assert no_model.status_code == 422


# -- Request validation ------------------------------------------------------


def test_tier_all_is_rejected():
    with _client() as client:
        resp = client.post("/events", json={"batches": [_batch(tier="all")]})
        assert resp.status_code == 422


def test_seq_zero_is_rejected():
    with _client() as client:
        resp = client.post("/events", json={"batches": [_batch(seq=0)]})
        assert resp.status_code == 422


def test_malformed_key_hex_is_rejected():
    with _client() as client:
        resp = client.post("/events", json={"batches": [_batch(entries=[{"key": _key(h="zz")}])]})
        assert resp.status_code == 422


def test_stats_reports_blend_index_counts():
    """The e2e ladder needs a way to confirm the fleet index actually got populated from the
    event stream."""
    content = _chunk_tokens(1000, LMCACHE_CHUNK_SIZE)
    with _blend_client() as client:
        assert client.get("/directory/stats").json()["blend"] == {
            "num_contents": 0, "num_chunks": 0, "num_claims": 0, "num_namespaces": 0, "table_size": 1024}

        entry = {"key": _key(), "size_bytes": 1024, "token_ids": content, "token_offset": 0}
        _post_events(client, [_batch(entries=[entry])])

        data = client.get("/directory/stats").json()["blend"]
        assert data["num_contents"] == 1
        assert data["num_chunks"] == 1
        assert data["num_claims"] == 1
        assert data["num_namespaces"] == 1


# ============================================================================ the blend client
CHUNK = 3
NS = BlendNamespace(model_name=MODEL, world_size=WORLD_SIZE)


def _directory_request(directory: KeyDirectory) -> Callable[[str, str, dict], dict]:
    """request_fn driving a real directory, mirroring the coordinator router."""

    def request(method: str, path: str, payload: dict) -> dict:
        if method == "POST" and path == "/directory/blend-lookup":
            namespace = BlendNamespace(model_name=payload["model_name"], cache_salt=payload["cache_salt"],
                                       world_size=payload["world_size"])
            matches = directory.blend_match(decode_b64(payload["tokens_b64"]), namespace)
            return {"matches": [{"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st}
                                for m in matches]}
        raise AssertionError(f"unexpected {method} {path}")

    return request


def _stored(directory: KeyDirectory, chunks: list[list[int]]) -> list[bytes]:
    """Feed ``chunks`` in as cache events; return their chunk hashes."""
    hashes = [bytes([index + 1]) * 4 for index in range(len(chunks))]
    for seq, (chunk_hash, tokens) in enumerate(zip(hashes, chunks, strict=True), 1):
        directory.apply({"batches": [{
            "instance_id": "node-a", "incarnation": 1, "seq": seq, "event_type": "store", "tier": "l1",
            "backend": "dram",
            "entries": [{"key": {"chunk_hash_hex": chunk_hash.hex(), "model_name": MODEL,
                                 "kv_rank": pack_kv_rank(WORLD_SIZE, 0, WORLD_SIZE, 0)},
                         "size_bytes": 100, "token_ids": tokens, "token_offset": (seq - 1) * CHUNK}]}]})
    return hashes


def _directory() -> KeyDirectory:
    directory = KeyDirectory()
    directory.enable_blend_lookup(chunk_size=CHUNK, probe_stride=1)
    return directory


def _wait_match(client: BlendCoordinatorClient, rid: str, timeout: float = 2.0):
    end = time.time() + timeout
    while time.time() < end:
        v = client.poll_match(rid)
        if isinstance(v, list):
            return v
        time.sleep(0.005)
    return client.poll_match(rid)


def test_match_finds_chunks_the_event_stream_reported():
    directory = _directory()
    hashes = _stored(directory, [[1, 2, 3], [4, 5, 6]])
    client = BlendCoordinatorClient(request_fn=_directory_request(directory))
    try:
        client.submit_match("r1", [1, 2, 3, 4, 5, 6], NS)
        matches = _wait_match(client, "r1")
        assert isinstance(matches, list)
        # chunk_hash arrives as bytes, matching a local CBMatchResult.hash.
        assert [(x.chunk_hash, x.old_st, x.cur_st) for x in matches] == [(hashes[0], 0, 0), (hashes[1], 3, 3)]
    finally:
        client.close()


def test_match_is_empty_when_nothing_is_cached():
    client = BlendCoordinatorClient(request_fn=_directory_request(_directory()))
    try:
        client.submit_match("r1", [1, 2, 3], NS)
        assert _wait_match(client, "r1") == []
    finally:
        client.close()


def test_poll_none_before_submit():
    client = BlendCoordinatorClient(request_fn=lambda mth, p, b: {})
    try:
        assert client.poll_match("never") is None
    finally:
        client.close()


def test_submit_is_idempotent():
    directory = _directory()
    _stored(directory, [[1, 2, 3]])
    client = BlendCoordinatorClient(request_fn=_directory_request(directory))
    try:
        client.submit_match("r1", [1, 2, 3], NS)
        client.submit_match("r1", [1, 2, 3], NS)  # no-op
        matches = _wait_match(client, "r1")
        assert isinstance(matches, list) and len(matches) == 1
    finally:
        client.close()


def test_match_error_degrades_to_empty():
    def boom(method: str, path: str, payload: dict) -> dict:
        raise RuntimeError("coordinator down")

    client = BlendCoordinatorClient(request_fn=boom)
    try:
        client.submit_match("r1", [1, 2, 3], NS)
        matches = _wait_match(client, "r1")
        assert matches == []  # failure -> local-only, never hangs
    finally:
        client.close()


def test_take_match_clears():
    directory = _directory()
    _stored(directory, [[1, 2, 3]])
    client = BlendCoordinatorClient(request_fn=_directory_request(directory))
    try:
        client.submit_match("r1", [1, 2, 3], NS)
        _wait_match(client, "r1")
        client.take_match("r1")
        assert client.poll_match("r1") is None
    finally:
        client.close()


def test_maybe_create():
    kwargs = {"timeout": 1.0, "match_concurrency": 8}
    assert BlendCoordinatorClient.maybe_create("", **kwargs) is None
    assert BlendCoordinatorClient.maybe_create("   ", **kwargs) is None
    assert BlendCoordinatorClient.maybe_create(None, **kwargs) is None

    client = BlendCoordinatorClient.maybe_create("http://coord:9300", **kwargs)
    assert client is not None
    assert client.match_budget_s == 1.0
    client.close()

    client = BlendCoordinatorClient.maybe_create("http://coord:9300", timeout=1.5, match_concurrency=2)
    assert client is not None
    assert client.match_budget_s == 1.5
    client.close()


def test_maybe_create_rejects_bad_concurrency():
    with pytest.raises(ValueError):
        BlendCoordinatorClient.maybe_create("http://coord:9300", timeout=1.0, match_concurrency=0)


def test_pending_sentinel_distinct():
    assert PENDING is not None and not isinstance(PENDING, list)


def test_match_carries_the_namespace_to_the_coordinator():
    """The server's own model, salt, and world size travel with the query so the coordinator
    can scope matches to keys this server can expand."""
    sent: list[dict] = []

    def capture(method: str, path: str, payload: dict) -> dict:
        sent.append(payload)
        return {"matches": []}

    client = BlendCoordinatorClient(request_fn=capture)
    try:
        namespace = BlendNamespace(model_name="llama", cache_salt="tenant-a", world_size=4)
        client.submit_match("r1", [1, 2, 3], namespace)
        _wait_match(client, "r1")
        assert sent == [{"tokens_b64": encode_tokens([1, 2, 3]), "model_name": "llama", "cache_salt": "tenant-a",
                         "world_size": 4}]
    finally:
        client.close()


def test_another_namespace_gets_no_match_for_the_same_content():
    directory = _directory()
    _stored(directory, [[1, 2, 3]])
    client = BlendCoordinatorClient(request_fn=_directory_request(directory))
    try:
        client.submit_match("r1", [1, 2, 3], BlendNamespace(model_name="other"))
        assert _wait_match(client, "r1") == []
    finally:
        client.close()
