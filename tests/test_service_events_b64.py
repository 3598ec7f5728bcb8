"""``POST /events`` entries carrying ``tokens_b64`` (our extension) over HTTP, in-process."""

from __future__ import annotations

import numpy as np
import pytest

from blendmatch.index.wire_models import wire_batch, wire_entry
from blendmatch.index.types import pack_kv_rank
from service_support import MODEL, b64, chunks, events, hash_of, served

pytestmark = pytest.mark.anyio


def _batch_counts(reply: dict) -> dict:
    """LMCache's three batch counts of a POST /events reply (ours add per-entry fields)."""
    return {k: reply[k] for k in ("applied", "duplicates", "stale")}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def b64_store(instance: str, seq: int, rows: np.ndarray, offsets: list[int]) -> dict:
    entries = []
    for i, row in enumerate(rows):
        entry = wire_entry(hash_of(i), MODEL, pack_kv_rank(1), size_bytes=1024, token_offset=offsets[i])
        entry["tokens_b64"] = b64(row)
        entries.append(entry)
    return wire_batch(instance, seq, "store", entries)


async def test_store_with_tokens_b64_then_blend_lookup_finds_the_chunk():
    rows = chunks(3, seed=5)
    async with served() as (client, _):
        r = await client.post("/events", json=events(b64_store("i1", 1, rows, offsets=[0, 16, 256])))
        assert r.status_code == 200, r.text
        assert _batch_counts(r.json()) == {"applied": 1, "duplicates": 0, "stale": 0}
        q = np.concatenate([np.arange(60_000, 60_007, dtype=np.uint32), rows[2], rows[0]])
        r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(q), "model_name": MODEL})
        assert r.status_code == 200, r.text
        assert r.json() == {"matches": [{"chunk_hash": hash_of(2).hex(), "old_st": 256, "cur_st": 7},
                                        {"chunk_hash": hash_of(0).hex(), "old_st": 0, "cur_st": 7 + rows.shape[1]}]}


async def test_bad_tokens_b64_is_a_422_naming_the_field_and_nothing_is_applied():
    rows = chunks(2, seed=6)
    bad = b64_store("i1", 1, rows, offsets=[0, 16])
    bad["entries"][1]["tokens_b64"] = "AQAA"  # 3 bytes: not a whole uint32
    async with served() as (client, _):
        r = await client.post("/events", json=events(bad))
        assert r.status_code == 422
        assert r.json()["detail"].startswith("body.batches.0.entries.1.tokens_b64: decoded byte length 3")
        both = b64_store("i1", 1, rows, offsets=[0, 16])
        both["entries"][0]["token_ids"] = rows[0].tolist()
        r = await client.post("/events", json=events(both))
        assert r.status_code == 422
        assert r.json()["detail"] == "body.batches.0.entries.0.tokens_b64: give token_ids or tokens_b64, not both"
        assert (await client.get("/directory/stats")).json()["num_keys"] == 0
