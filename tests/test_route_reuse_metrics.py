"""Reuse metrics (issue 26, part 3): per lookup, covered tokens split into prefix and
non-prefix, as Prometheus series labelled by model (never by salt) and in /directory/stats.

The fleet stores one sequence under the real prefix-chained hashes of the service's token
hasher (as LMCache's servers name chunks), and one chunk under a hash that is not chained:
its content matches, but a prefix cache would not find it.
"""

from __future__ import annotations

import numpy as np
import pytest

from blendmatch.index.types import pack_kv_rank
from blendmatch.index.wire_models import wire_batch, wire_entry
from service_support import C, MODEL, b64, chunks, events, hash_of, metric_samples, served

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


ROWS = chunks(6, seed=261)
SALT = "tenant-secret-salt"


def _store(instance: str, seq: int, hashes, rows, offsets, salt: str = ""):
    entries = [wire_entry(h, MODEL, pack_kv_rank(1), cache_salt=salt, size_bytes=1024, token_ids=r.tolist(),
                          token_offset=o) for h, r, o in zip(hashes, rows, offsets)]
    return wire_batch(instance, seq, "store", entries)


async def test_prefix_and_non_prefix_tokens_per_lookup():
    async with served() as (client, app):
        hasher = app.state.blendmatch_context.token_hasher
        seq = ROWS[0:4].reshape(-1)
        chained = hasher.chunk_hashes(seq)
        # chunks 0..3 under their chained hashes; chunk 4 stored at offset 2C under another hash
        body = events(_store("A", 1, chained, ROWS[0:4], [0, C, 2 * C, 3 * C]),
                      _store("A", 2, [hash_of(99)], ROWS[4:5], [2 * C]),
                      _store("A", 3, hasher.chunk_hashes(seq[:C]), ROWS[0:1], [0], salt=SALT))
        assert (await client.post("/events", json=body)).status_code == 200
        queries = [
            # 0 1 | 5 (unknown) | 3: prefix 2 chunks, then chunk 3 as a fragment
            (np.concatenate([ROWS[0], ROWS[1], ROWS[5], ROWS[3]]), 2 * C, C),
            # 0 1 4 (4 sits at 2C but not under the chained hash): prefix 2, fragment 1
            (np.concatenate([ROWS[0], ROWS[1], ROWS[4]]), 2 * C, C),
            # 5 0 1: no prefix; 0 and 1 are fragments
            (np.concatenate([ROWS[5], ROWS[0], ROWS[1]]), 0, 2 * C),
            # 0 1 2 3 plus a partial chunk: all prefix
            (np.concatenate([seq, ROWS[5][:3]]), 4 * C, 0),
        ]
        for tokens, _, _ in queries[:2]:
            r = await client.post("/directory/blend-lookup", json={"tokens_b64": b64(tokens), "model_name": MODEL})
            assert r.status_code == 200
        r = await client.post("/directory/blend-lookup/batch", json={"queries": [
            {"token_ids": queries[2][0].tolist(), "model_name": MODEL},
            {"tokens_b64": b64(queries[3][0]), "model_name": MODEL, "include_placements": True}]})
        assert r.status_code == 200
        # the routing score is not a lookup: not counted
        assert (await client.post("/route/score", json={"tokens_b64": b64(seq), "model_name": MODEL})
                ).status_code == 200
        # another tenant (a salt): counted under the same model label, never by salt
        r = await client.post("/directory/blend-lookup", json={"token_ids": ROWS[0].tolist(), "model_name": MODEL,
                                                               "cache_salt": SALT})
        assert len(r.json()["matches"]) == 1

        prefix = sum(q[1] for q in queries) + C
        rest = sum(q[2] for q in queries)
        n_tokens = sum(int(q[0].shape[0]) for q in queries) + C
        stats = (await client.get("/directory/stats")).json()
        assert "reuse" not in stats
        reuse = stats["blendmatch"]["reuse"]
        assert reuse["by_model"] == {MODEL: {"lookups": 5, "query_tokens": n_tokens, "prefix_tokens": prefix,
                                             "non_prefix_tokens": rest}}
        assert reuse["lookups"] == 5 and reuse["prefix_tokens"] == prefix

        text = (await client.get("/metrics")).text
        assert SALT not in text
        m = metric_samples(text)
        assert m[f'blendmatch_reuse_tokens_total{{kind="prefix",model="{MODEL}"}}'] == prefix
        assert m[f'blendmatch_reuse_tokens_total{{kind="non_prefix",model="{MODEL}"}}'] == rest
        assert m[f'blendmatch_reuse_query_tokens_total{{model="{MODEL}"}}'] == n_tokens
        assert m[f'blendmatch_reuse_tokens_per_lookup_count{{kind="prefix",model="{MODEL}"}}'] == 5
        # per lookup: the prefix histogram saw 2C, 2C, 0, 4C, C
        assert m[f'blendmatch_reuse_tokens_per_lookup_bucket{{kind="prefix",le="0.0",model="{MODEL}"}}'] == 1


def test_model_labels_are_bounded(monkeypatch):
    from prometheus_client import CollectorRegistry

    from blendmatch.index.key_directory import KeyDirectory
    from blendmatch.index.token_hasher import TokenHasher
    from blendmatch.index.types import BlendNamespace
    from blendmatch.service import reuse_metrics

    monkeypatch.setattr(reuse_metrics, "MAX_MODELS", 2)
    directory = KeyDirectory()
    rm = reuse_metrics.ReuseMetrics(CollectorRegistry(), directory, TokenHasher("blake3", C))
    tokens = np.arange(C, dtype=np.uint32)
    rm.observe([(BlendNamespace(f"m{i}"), tokens, []) for i in range(4)])
    assert sorted(rm.stats()["by_model"]) == ["__other__", "m0", "m1"]
    assert rm.stats()["by_model"]["__other__"]["lookups"] == 2


def test_remembered_chain_hashes_are_used_only_for_the_same_tokens():
    """The memo of chained hashes is keyed by the matched chunk hash, whose content can change
    (a STORE of other tokens under the same hash): the new tokens are hashed again, so a
    chunk that is no longer a prefix hit is not counted as one."""
    from prometheus_client import CollectorRegistry

    from blendmatch.index.key_directory import KeyDirectory
    from blendmatch.index.token_hasher import TokenHasher
    from blendmatch.index.types import BlendNamespace
    from blendmatch.service.reuse_metrics import ReuseMetrics

    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, engine="reference")
    hasher = TokenHasher("blake3", C)
    rm = ReuseMetrics(CollectorRegistry(), d, hasher)
    ns = BlendNamespace(MODEL)
    old, new = ROWS[0], ROWS[1]
    (h0,) = hasher.chunk_hashes(old)

    def count(tokens: np.ndarray) -> tuple[int, int]:
        before = rm.stats()
        rm.observe([(ns, tokens, d.blend_match(tokens, ns))])
        after = rm.stats()
        return (after["prefix_tokens"] - before["prefix_tokens"],
                after["non_prefix_tokens"] - before["non_prefix_tokens"])

    d.apply(events(_store("A", 1, [h0], [old], [0])))
    assert count(old) == (C, 0) and count(old) == (C, 0)  # the second one from the memo
    d.apply(events(_store("A", 2, [h0], [new], [0])))  # same chunk hash, other tokens
    assert d.blend_match(new, ns) and count(new) == (0, C)
