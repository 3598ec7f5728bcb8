"""Property tests: BlendIndex against the brute-force oracle (tests/oracle.py) over random
contents, namespaces, strides, shared content under several chunk hashes, removals and
forced fingerprint collisions, on every engine."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from blendmatch.index import BlendIndex, BlendNamespace
from oracle import OracleIndex, thue_morse

NAMESPACES = [BlendNamespace("m"), BlendNamespace("m", "s"), BlendNamespace("m", "", 2), BlendNamespace("n")]
HASHES = [bytes([i]) * 4 for i in range(6)]

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 7), st.integers(0, 5), st.integers(-1, 40), st.integers(0, 3)),
    st.tuples(st.just("remove_claim"), st.integers(0, 7), st.integers(0, 5), st.just(0), st.integers(0, 3)),
    st.tuples(st.just("remove_chunk"), st.integers(0, 7), st.integers(0, 5), st.just(0), st.just(0)),
)


def _run(idx: BlendIndex, oracle: OracleIndex, pool, ops, queries) -> None:
    for kind, ci, hi, off, ni in ops:
        tokens, h, ns = pool[ci], HASHES[hi], NAMESPACES[ni]
        if kind == "add":
            got = idx.add(tokens, h, off, ns) is not None
            assert got == oracle.add(tokens, h, off, ns)
        elif kind == "remove_claim":
            assert idx.remove_claim(tokens, h, ns) == oracle.remove_claim(tokens, h, ns)
        else:
            assert idx.remove_chunk(tokens, h) == oracle.remove_chunk(tokens, h)
    got = idx.match_batch(queries)
    want = [oracle.match(q, ns) for q, ns in queries]
    assert got == want
    counts = oracle.counts()
    stats = idx.stats()
    assert {k: stats[k] for k in counts} == counts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    c=st.integers(1, 6),
    stride=st.integers(1, 7),
    filter=st.sampled_from(["tagged", "occupancy"]),
    seed=st.integers(0, 2**32 - 1),
    ops=st.lists(op, max_size=40),
    n_queries=st.integers(0, 5),
)
# LMCache's per-position rule: content 0 (= content 1) under hashes 0, 1, 2 then queried
# with repeated copies must give one hash per copy, in first-indexed order
@example(c=3, stride=1, filter="tagged", seed=7, n_queries=5,
         ops=[("add", 0, 0, 3, 0), ("add", 1, 1, 6, 0), ("add", 0, 2, 9, 0), ("remove_claim", 0, 0, 0, 0),
              ("add", 0, 0, 3, 0)])
def test_index_matches_oracle(engine, c, stride, filter, seed, ops, n_queries):
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, 3, size=c + (1 if i == 7 else 0), dtype=np.uint32) for i in range(8)]  # 7: wrong length
    pool[1] = pool[0].copy()  # the same content under several hashes / entries
    idx = BlendIndex(chunk_size=c, probe_stride=stride, engine=engine, filter=filter)
    oracle = OracleIndex(c, stride)
    queries = []
    for _ in range(n_queries):
        parts = [pool[int(i)] for i in rng.integers(0, 8, size=int(rng.integers(0, 6)))]
        parts.append(rng.integers(0, 3, size=int(rng.integers(0, 2 * c + 2)), dtype=np.uint32))
        rng.shuffle(parts)
        queries.append((np.concatenate(parts) if parts else np.zeros(0, np.uint32),
                        NAMESPACES[int(rng.integers(0, 4))]))
    _run(idx, oracle, pool, ops, queries)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=25), seed=st.integers(0, 2**32 - 1), stride=st.sampled_from([1, 512, 2048]))
def test_forced_collisions_against_oracle(engine, ops, seed, stride):
    t = np.array(thue_morse(11), dtype=np.uint32)
    c = t.size
    rng = np.random.default_rng(seed)
    pool = [t, 1 - t, t, 1 - t] + [rng.integers(0, 2, size=c, dtype=np.uint32) for _ in range(3)] + [t[:5]]
    idx = BlendIndex(chunk_size=c, probe_stride=stride, engine=engine)
    oracle = OracleIndex(c, stride)
    queries = [(np.concatenate([pool[1], pool[0], pool[4]]), ns) for ns in NAMESPACES[:2]]
    _run(idx, oracle, pool, ops, queries)
