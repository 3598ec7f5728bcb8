"""BlendIndex semantics (index/blend_index.py, index/verify.py), edge cases on purpose."""

from __future__ import annotations

import numpy as np
import pytest

from blendmatch.gpu.engine import EngineFailure
from blendmatch.index import BlendIndex, BlendMatch, BlendNamespace
from oracle import thue_morse

A = BlendNamespace("llama", "", 1)
A2 = BlendNamespace("llama", "salt", 1)
A4 = BlendNamespace("llama", "", 4)
OTHER = BlendNamespace("mistral", "", 1)


def _idx(c=4, stride=1, filter="tagged"):
    return BlendIndex(chunk_size=c, probe_stride=stride, engine="cpu", filter=filter)


def test_constructor_rejects_bad_sizes():
    for kwargs in ({"chunk_size": 0}, {"probe_stride": 0}, {"chunk_size": -3}, {"chunk_size": 2.5}):
        with pytest.raises(ValueError):
            BlendIndex(engine="cpu", **kwargs)
    with pytest.raises(ValueError, match="engine"):
        BlendIndex(engine="tpu")
    with pytest.raises(ValueError, match="filter"):
        BlendIndex(engine="cpu", filter="bloom")


def test_namespaces_never_cross():
    idx = _idx()
    idx.add([1, 2, 3, 4], b"a", 0, A)
    q = [1, 2, 3, 4]
    assert idx.match(q, A) == [BlendMatch(b"a", 0, 0)]
    for ns in (A2, A4, OTHER):
        assert idx.match(q, ns) == []
    idx.add([1, 2, 3, 4], b"a", 0, A2)  # a second namespace joins the claim set
    assert idx.match(q, A2) == [BlendMatch(b"a", 0, 0)]
    assert idx.stats()["num_claims"] == 2 and idx.stats()["num_chunks"] == 1


def test_per_position_rule_one_match_per_position_first_indexed_order(engine):
    """LMCache 0.5.6's rule: ascending positions, one seen set per lookup; at each position
    the first claimed, unseen, verified occupant, then the next position."""
    idx = BlendIndex(chunk_size=4, engine=engine)
    idx.add([1, 2, 3, 4], b"x", 100, A)
    idx.add([1, 2, 3, 4], b"y", 200, A)  # same content under a second chunk hash
    idx.add([5, 6, 7, 8], b"z", 300, A)
    q = [0, 5, 6, 7, 8, 1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 8]
    assert idx.match(q, A) == [BlendMatch(b"z", 300, 1), BlendMatch(b"x", 100, 5), BlendMatch(b"y", 200, 9)]
    # C stored under A then B; query C..C -> A at the first copy, B at the second, nothing after
    ccc = [1, 2, 3, 4] * 3
    assert idx.match(ccc, A) == [BlendMatch(b"x", 100, 0), BlendMatch(b"y", 200, 4)]
    # an occupant the caller does not claim is skipped, not consumed
    idx.add([1, 2, 3, 4], b"w", 50, OTHER)
    assert idx.match(ccc, OTHER) == [BlendMatch(b"w", 50, 0)]
    # removed and re-added: it goes to the end of the occupant order
    idx.remove_claim([1, 2, 3, 4], b"x", A)
    idx.add([1, 2, 3, 4], b"x", 100, A)
    assert idx.match(ccc, A) == [BlendMatch(b"y", 200, 0), BlendMatch(b"x", 100, 4)]
    # the batch path answers the same, query by query (one seen set per query)
    assert idx.match_batch([(ccc, A), (ccc, A), (ccc, OTHER)]) == [idx.match(ccc, A)] * 2 + [idx.match(ccc, OTHER)]


def test_overlapping_windows_both_match():
    idx = _idx()
    idx.add([1, 1, 1, 2], b"p", 0, A)
    idx.add([1, 1, 2, 1], b"q", 4, A)
    assert idx.match([1, 1, 1, 2, 1], A) == [BlendMatch(b"p", 0, 0), BlendMatch(b"q", 4, 1)]


def test_probe_stride_probes_only_multiples():
    idx = _idx(stride=2)
    idx.add([1, 2, 3, 4], b"a", 0, A)
    assert idx.match([9, 1, 2, 3, 4], A) == []
    assert idx.match([9, 9, 1, 2, 3, 4], A) == [BlendMatch(b"a", 0, 2)]


def test_unknown_offset_and_wrong_length_are_not_indexed():
    idx = _idx()
    assert idx.add([1, 2, 3, 4], b"a", -1, A) is None
    assert idx.add([1, 2, 3], b"b", 0, A) is None
    assert idx.add([1, 2, 3, 4, 5], b"c", 0, A) is None
    assert idx.match([1, 2, 3, 4, 5], A) == []
    assert idx.stats()["num_contents"] == 0
    with pytest.raises(ValueError, match="token_offset"):
        idx.add([1, 2, 3, 4], b"a", -2, A)


def test_offset_updates_but_never_downgrades():
    idx = _idx()
    row = idx.add([1, 2, 3, 4], b"a", 8, A)
    assert row is not None and row.tolist() == [1, 2, 3, 4] and not row.flags.writeable
    idx.add([1, 2, 3, 4], b"a", 16, A)
    assert idx.match([1, 2, 3, 4], A)[0].old_st == 16
    idx.add([1, 2, 3, 4], b"a", -1, A2)  # joins with no offset: keeps 16
    assert idx.match([1, 2, 3, 4], A2)[0].old_st == 16


def test_remove_claim_then_occupant_then_content():
    idx = _idx()
    idx.add([1, 2, 3, 4], b"a", 0, A)
    idx.add([1, 2, 3, 4], b"a", 0, A2)
    assert idx.remove_claim([1, 2, 3, 4], b"a", A)
    assert not idx.remove_claim([1, 2, 3, 4], b"a", A)  # no-op the second time
    assert idx.match([1, 2, 3, 4], A) == [] and idx.match([1, 2, 3, 4], A2) != []
    assert idx.remove_claim([1, 2, 3, 4], b"a", A2)
    st = idx.stats()
    assert (st["num_contents"], st["num_chunks"], st["num_claims"], st["num_namespaces"]) == (0, 0, 0, 0)
    assert not idx.remove_claim([9, 9, 9, 9], b"a", A2)


def test_remove_chunk_drops_all_claims_but_keeps_other_occupants():
    idx = _idx()
    idx.add([1, 2, 3, 4], b"a", 0, A)
    idx.add([1, 2, 3, 4], b"a", 0, A2)
    idx.add([1, 2, 3, 4], b"b", 4, A)
    assert idx.remove_chunk([1, 2, 3, 4], b"a")
    assert idx.match([1, 2, 3, 4], A) == [BlendMatch(b"b", 4, 0)]
    assert idx.match([1, 2, 3, 4], A2) == []
    assert idx.stats()["num_claims"] == 1


def test_fingerprint_collision_with_different_content_stays_apart():
    t = thue_morse(11)
    u = [1 - x for x in t]
    idx = BlendIndex(chunk_size=len(t), engine="cpu")
    assert idx.add(t, b"t", 0, A) is not None
    assert idx.add(u, b"u", 0, A) is None  # same fingerprint, other tokens: not attached
    assert idx.stats()["collisions"] == 1
    assert idx.match(u, A) == []
    assert idx.match(t, A) == [BlendMatch(b"t", 0, 0)]
    assert not idx.remove_chunk(u, b"t")  # wrong content never removes the indexed one
    assert idx.match(t, A) == [BlendMatch(b"t", 0, 0)]


def test_seen_is_marked_only_after_verification():
    # The collision pair: the query first shows the colliding (unverifiable) window, then the
    # real content; the chunk must still be found at the second position.
    t = thue_morse(11)
    u = [1 - x for x in t]
    idx = BlendIndex(chunk_size=len(t), probe_stride=len(t), engine="cpu")
    idx.add(t, b"t", 0, A)
    _, stats = idx.match_batch_detailed([(u + t, A)])
    assert idx.match(u + t, A) == [BlendMatch(b"t", 0, len(t))]
    assert stats.token_rejections == 1


def test_namespace_filter_runs_before_token_comparison():
    t = thue_morse(11)
    u = [1 - x for x in t]
    idx = BlendIndex(chunk_size=len(t), engine="cpu")
    idx.add(t, b"t", 0, A)
    _, stats = idx.match_batch_detailed([(u, OTHER)])
    assert stats.ns_filtered == 1 and stats.token_rejections == 0


def test_bad_query_input_rejected_whole():
    idx = _idx()
    idx.add([1, 2, 3, 4], b"a", 0, A)
    with pytest.raises(ValueError, match="query 1"):
        idx.match_batch([([1, 2, 3, 4], A), ([1, -2, 3, 4], A)])
    with pytest.raises(ValueError, match="BlendNamespace"):
        idx.match([1, 2, 3, 4], ("llama", "", 1, 9))
    with pytest.raises(ValueError, match="bytes"):
        idx.add([1, 2, 3, 4], "a", 0, A)
    with pytest.raises(ValueError, match="dtype float"):
        idx.add(np.array([1.5, 2, 3, 4]), b"a", 0, A)
    assert idx.match([], A) == [] and idx.match([1, 2], A) == []
    assert idx.match_batch([]) == []


def test_add_many_equals_sequential_adds(rng):
    c = 4
    rows = rng.integers(0, 4, size=(300, c), dtype=np.uint32)  # many duplicates in the batch
    hashes = [b"h%d" % (i % 50) for i in range(300)]
    offsets = np.where((o := rng.integers(-1, 3, size=300)) < 0, -1, o * c)
    nss = [(A, A2, A4)[i % 3] for i in range(300)]
    bulk, seq = _idx(c), _idx(c)
    got = bulk.add_many(rows, hashes, offsets, nss)
    want = [seq.add(r, h, int(o), n) for r, h, o, n in zip(rows, hashes, offsets, nss)]
    assert [g is None for g in got] == [w is None for w in want]
    queries = [(rng.integers(0, 4, size=64, dtype=np.uint32), ns) for ns in (A, A2, A4)]
    assert bulk.match_batch(queries) == seq.match_batch(queries)
    s1, s2 = bulk.stats(), seq.stats()
    for k in ("num_contents", "num_chunks", "num_claims", "num_namespaces"):
        assert s1[k] == s2[k]


def test_add_many_validates_everything_before_applying():
    idx = _idx()
    with pytest.raises(ValueError, match="2\\^32"):
        idx.add_many(np.array([[1, 2, 3, 4], [1, 2, 3, 1 << 32]]), [b"a", b"b"], [0, 4], A)
    with pytest.raises(ValueError, match="entries"):
        idx.add_many(np.array([[1, 2, 3, 4]], dtype=np.uint32), [b"a", b"b"], [0], A)
    with pytest.raises(ValueError, match="bytes"):
        idx.add_many(np.array([[1, 2, 3, 4]], dtype=np.uint32), ["a"], [0], A)
    assert idx.stats()["num_contents"] == 0
    assert idx.add_many(np.zeros((2, 3), dtype=np.uint32), [b"a", b"b"], [0, 0], A) == [None, None]


def test_growth_rebuilds_keep_every_chunk_findable(rng):
    idx = BlendIndex(chunk_size=8, engine="cpu")
    rows = rng.integers(0, 1 << 32, size=(5000, 8), dtype=np.uint64).astype(np.uint32)
    idx.add_many(rows, [b"%d" % i for i in range(5000)], np.arange(5000) * 8, A)
    st = idx.stats()
    assert st["table_size"] >= 16 * 5000 and st["rebuilds"] >= 1
    res = idx.match(rows.ravel(), A)
    assert [m.cur_st for m in res] == list(range(0, 5000 * 8, 8))
    for i in range(0, 5000, 2):
        idx.remove_claim(rows[i], b"%d" % i, A)
    res = idx.match(rows.ravel(), A)
    assert [m.cur_st for m in res] == list(range(8, 5000 * 8, 16))


class _FailingEngine:
    name = "gpu"
    reason = "test double"

    def __init__(self):
        self.closed = False

    def probe(self, batch, slots):
        raise EngineFailure("CUDA error: device lost (simulated)")

    def close(self):
        self.closed = True


def test_gpu_failure_fails_over_to_cpu_with_identical_answers(caplog):
    failing = _FailingEngine()
    idx = BlendIndex(chunk_size=4, engine=failing)
    idx.add([1, 2, 3, 4], b"a", 0, A)
    assert idx.match([0, 1, 2, 3, 4], A) == [BlendMatch(b"a", 0, 1)]
    st = idx.stats()
    assert st["engine"] == "cpu" and st["engine_failovers"] == 1 and failing.closed
    assert "failover from gpu" in st["engine_reason"]
    assert any("continuing on the CPU engine" in r.message for r in caplog.records)
    assert idx.match([1, 2, 3, 4], A) == [BlendMatch(b"a", 0, 0)]
    assert idx.stats()["engine_failovers"] == 1


def test_memory_per_chunk_is_small(rng):
    idx = BlendIndex(chunk_size=256, engine="cpu")
    n = 20_000
    rows = rng.integers(0, 1 << 31, size=(n, 256), dtype=np.uint32)
    idx.add_many(rows, [i.to_bytes(32, "little") for i in range(n)], np.arange(n) * 256, A)
    # tokens are 1024 B; the rest (map, slots, columns, hashes, block slack) must stay small.
    # (Block slack of the last 8 MiB block dominates at this size; the benchmark measures 1M.)
    per_chunk = idx.memory_bytes() / n
    assert per_chunk < 1024 + 600, per_chunk


def test_reserve_keeps_answers_and_avoids_growth(rng):
    idx = BlendIndex(chunk_size=8, engine="cpu")
    rows = rng.integers(0, 1 << 31, size=(3000, 8), dtype=np.uint32)
    idx.add_many(rows[:10], [b"%d" % i for i in range(10)], np.arange(10) * 8, A)
    idx.reserve(3000)
    size, rebuilds = idx.stats()["table_size"], idx.stats()["rebuilds"]
    assert size >= 16 * 3000
    idx.add_many(rows[10:], [b"%d" % i for i in range(10, 3000)], np.arange(10, 3000) * 8, A)
    st = idx.stats()
    assert st["table_size"] == size and st["rebuilds"] == rebuilds
    assert [m.cur_st for m in idx.match(rows.ravel(), A)] == list(range(0, 3000 * 8, 8))
    with pytest.raises(ValueError):
        idx.reserve(-1)


def test_token_store_writes_and_views_rows_across_blocks(rng):
    """Bulk writes of consecutive rows (one slice per block) and scattered ones agree with a
    plain model; row views are read-only and share the store's memory."""
    from blendmatch.index.storage import TokenStore

    store = TokenStore(3, block_shift=2)  # 4 rows per block: runs cross block boundaries
    model: dict[int, list[int]] = {}
    for rows in ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9], [11], [2, 0, 1], [14, 12, 13], [10, 15, 16, 17]):
        tokens = rng.integers(0, 1 << 32, size=(len(rows), 3), dtype=np.uint32)
        store.write(np.array(rows, dtype=np.int64), tokens)
        model.update(zip(rows, tokens.tolist()))
        ids = np.array(sorted(model), dtype=np.int64)
        for subset in (ids, ids[::-1], ids[1:5], ids[3:4]):
            views = store.rows(subset)
            assert [v.tolist() for v in views] == [model[r] for r in subset.tolist()]
            assert all(not v.flags.writeable for v in views)
    assert np.shares_memory(store.rows(np.array([5], dtype=np.int64))[0], store._py_blocks[1])


def test_memory_bytes_tracks_hashes_without_walking_them():
    import sys

    idx = _idx()
    base = idx.memory_bytes()
    idx.add([1, 2, 3, 4], b"x" * 40, 0, A)
    idx.add([1, 2, 3, 4], b"y" * 40, 4, A)
    grown = idx.memory_bytes()
    assert grown - base >= 2 * sys.getsizeof(b"x" * 40)
    idx.remove_chunk([1, 2, 3, 4], b"x" * 40)
    idx.remove_chunk([1, 2, 3, 4], b"y" * 40)
    assert idx.memory_bytes() - base < sys.getsizeof(b"x" * 40)  # only the list's own slots remain


def test_warm_up_leaves_the_index_untouched():
    idx = _idx()
    idx.add([1, 2, 3, 4], b"a", 0, A)
    before = idx.stats()
    idx.warm_up()
    assert idx.stats() == before
    assert idx.match([1, 2, 3, 4], A) == [BlendMatch(b"a", 0, 0)]


def test_one_chunk_hash_under_two_contents_is_taken_once_per_query():
    """Through the index's own API one chunk hash can occupy two contents; "taken" then goes
    by hash (the oracle's rule), not by occupant."""
    from oracle import OracleIndex

    idx, oracle = _idx(), OracleIndex(4)
    for tokens, h, off in (([1, 2, 3, 4], b"h", 10), ([5, 6, 7, 8], b"h", 20), ([5, 6, 7, 8], b"k", 30),
                           ([1, 2, 3, 4], b"k", 40)):
        idx.add(tokens, h, off, A)
        oracle.add(tokens, h, off, A)
    q = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8]
    assert idx.match(q, A) == oracle.match(q, A) == [BlendMatch(b"h", 10, 0), BlendMatch(b"k", 30, 4)]


def test_per_position_rule_work_is_linear_in_positions_plus_occupants():
    """Many copies of one chunk (the same content under many chunk hashes) and a long query
    of that content: every window verifies, and each may take one unseen hash. The rule's
    work must grow with positions + occupants, not positions x occupants (issue 23: 1,000
    copies and a 10,000-token query took 6.4 s and 1.7 GB when every pair was walked)."""
    idx = _idx(c=4)
    copies = 300
    idx.add_many(np.full((copies, 4), 7, dtype=np.uint32), [i.to_bytes(4, "little") for i in range(copies)],
                 np.zeros(copies, dtype=np.int64), A)
    idx.add([7, 7, 7, 7], b"other-ns", 0, OTHER)  # an occupant the requester does not claim
    q = np.full(2000, 7, dtype=np.uint32)
    (got,), stats = idx.match_batch_detailed([(q, A)])
    positions = q.size - 4 + 1
    assert [m.chunk_hash for m in got] == [i.to_bytes(4, "little") for i in range(copies)]
    assert [m.cur_st for m in got] == list(range(copies))
    assert stats.matches == copies
    assert stats.occupant_steps <= 3 * (positions + copies + 1)  # pairs walked: ~positions x copies
