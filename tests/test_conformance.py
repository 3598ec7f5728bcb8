"""One conformance suite, run against every engine (tests/engines.py): identical candidates to
the reference engine, bit for bit, and identical index answers through BlendIndex."""

from __future__ import annotations

import numpy as np
import pytest

from blendmatch.gpu.batch import Candidates, QueryBatch
from blendmatch.gpu.cpu import CHAINS, LANE
from blendmatch.gpu.engine import probe_many
from blendmatch.gpu.reference import ReferenceEngine
from blendmatch.index import BlendIndex, BlendMatch, BlendNamespace
from blendmatch.gpu.fingerprint import chunk_fingerprints
from blendmatch.index.slots import SlotArray

NS = BlendNamespace("m")


def _slots_with(chunks: np.ndarray, mode: str, extra_random: int = 0, rng=None, size: int | None = None) -> SlotArray:
    s = SlotArray(mode)
    fps = np.unique(chunk_fingerprints(chunks))
    if extra_random:
        fps = np.concatenate([fps, rng.integers(0, 1 << 63, size=extra_random, dtype=np.uint64)])
    s.rebuild(fps, size=size)
    return s


def _check(engine, batch: QueryBatch, slots: SlotArray) -> Candidates:
    got = engine.probe(batch, slots)
    want = ReferenceEngine().probe(batch, slots)
    assert got.same_as(want), f"{engine.name} differs from the reference"
    assert got.windows == want.windows == batch.num_windows()
    assert got.query_index.dtype == np.int64 and got.cur_st.dtype == np.int64 and got.fingerprint.dtype == np.uint64
    # the pipelined path (gpu/engine.py): three copies in flight two deep, each bit-identical
    for piped in probe_many(engine, [batch, batch, batch], slots, depth=2):
        assert piped.same_as(want) and piped.windows == want.windows, f"{engine.name} pipelined differs"
    return got


@pytest.mark.parametrize("mode", ["tagged", "occupancy"])
@pytest.mark.parametrize("stride", [1, 2, 3, 7, 8, 9])
def test_random_batches_match_reference(engine, rng, mode, stride):
    c = 8
    chunks = rng.integers(0, 30, size=(60, c), dtype=np.uint32)  # small alphabet: many hits
    # a small, crowded table: many shared slots and tag-only survivors
    slots = _slots_with(chunks, mode, extra_random=40, rng=rng, size=128)
    lengths = [0, 1, c - 1, c, c + 1, 50, 333, 2 * c]
    queries = [rng.integers(0, 30, size=n, dtype=np.uint32) for n in lengths]
    queries.append(chunks[:7].ravel())
    got = _check(engine, QueryBatch.from_queries(queries, c, stride), slots)
    assert len(got) > 0
    assert np.all(got.cur_st % stride == 0)


def test_empty_batch_and_short_queries(engine):
    slots = SlotArray()
    assert len(_check(engine, QueryBatch.from_queries([], 4, 1), slots)) == 0
    got = _check(engine, QueryBatch.from_queries([np.zeros(3, np.uint32)] * 5, 4, 1), slots)
    assert len(got) == 0 and got.windows == 0


def test_windows_never_cross_query_boundaries(engine):
    c = 4
    chunk = np.array([11, 12, 13, 14], dtype=np.uint32)
    slots = _slots_with(chunk[None, :], "tagged")
    # the chunk only exists across the boundary of query 0 and query 1
    q0 = np.array([1, 2, 11, 12], dtype=np.uint32)
    q1 = np.array([13, 14, 5, 6], dtype=np.uint32)
    assert len(_check(engine, QueryBatch.from_queries([q0, q1], c, 1), slots)) == 0
    whole = np.concatenate([q0, q1])
    got = _check(engine, QueryBatch.from_queries([whole], c, 1), slots)
    assert got.cur_st.tolist() == [2]


@pytest.mark.parametrize("mode", ["tagged", "occupancy"])
def test_chain_segments_and_lane_edges_match_the_reference(engine, rng, mode):
    """Window counts at the CPU engine's edges: an item is cut into CHAINS segments of
    LANE-window lanes plus a remainder of 0..CHAINS-1 windows (and fewer than CHAINS windows
    is all remainder). A crowded table makes a fifth or more of the windows survive, so a window
    hashed at the wrong position, or a survivor written in the wrong order, changes the
    candidates."""
    c = 8
    chunks = rng.integers(0, 4, size=(200, c), dtype=np.uint32)
    slots = _slots_with(chunks, mode, extra_random=200, rng=rng, size=512)
    span = CHAINS * LANE
    windows = sorted({1, 2, 3, CHAINS - 1, CHAINS, CHAINS + 1, 2 * CHAINS + 3, LANE - 1, LANE, LANE + 1,
                      span - 1, span, span + 1, span + CHAINS - 1, 2 * span + 2, 3 * span + CHAINS + 1})
    queries = [rng.integers(0, 4, size=n + c - 1, dtype=np.uint32) for n in windows]
    got = _check(engine, QueryBatch.from_queries(queries, c, 1), slots)
    assert len(got) > sum(windows) // 10
    for q, n in enumerate(windows):  # survivors stay inside their query
        starts = got.cur_st[got.query_index == q]
        assert np.all((starts >= 0) & (starts <= n - 1))


def test_shared_and_stale_slots(engine, rng):
    c = 8
    chunks = rng.integers(0, 1 << 32, size=(300, c), dtype=np.uint64).astype(np.uint32)
    s = SlotArray()
    fps = chunk_fingerprints(chunks)
    s.rebuild(fps, size=256)  # over-full on purpose: most slots shared
    s.remove(fps[:150])  # tagged ones clear, shared ones go stale
    queries = [chunks.ravel(), rng.integers(0, 1 << 31, size=999, dtype=np.uint32)]
    got = _check(engine, QueryBatch.from_queries(queries, c, 1), s)
    # recall: every remaining chunk start survives
    starts = set(got.cur_st[got.query_index == 0].tolist())
    assert {i * c for i in range(150, 300)} <= starts


def test_large_random_batch(engine, rng):
    c = 16
    chunks = rng.integers(0, 1 << 31, size=(500, c), dtype=np.uint32)
    slots = _slots_with(chunks, "tagged", extra_random=5000, rng=rng)
    queries = [np.concatenate([rng.integers(0, 1 << 31, size=int(rng.integers(0, 3000)), dtype=np.uint32),
                               chunks[rng.integers(0, 500, size=5)].ravel()]) for _ in range(12)]
    for stride in (1, 4):
        _check(engine, QueryBatch.from_queries(queries, c, stride), slots)


def test_index_answers_are_engine_independent(engine, rng):
    c = 8
    idx = BlendIndex(chunk_size=c, probe_stride=1, engine=engine)
    ref = BlendIndex(chunk_size=c, probe_stride=1, engine="reference")
    chunks = rng.integers(0, 20, size=(40, c), dtype=np.uint32)
    for i, ch in enumerate(chunks):
        ns = BlendNamespace("m", str(i % 3))
        for target in (idx, ref):
            target.add(ch, b"h%d" % i, i * c, ns)
    queries = [(np.concatenate([rng.integers(0, 20, size=30, dtype=np.uint32), chunks[i:i + 4].ravel()]),
                BlendNamespace("m", str(i % 3))) for i in range(0, 36, 3)]
    assert idx.match_batch(queries) == ref.match_batch(queries)
    assert idx.engine is engine


def test_match_results_shape(engine):
    idx = BlendIndex(chunk_size=4, engine=engine)
    idx.add([1, 2, 3, 4], b"\x01", 8, NS)
    assert idx.match([9, 1, 2, 3, 4], NS) == [BlendMatch(b"\x01", 8, 1)]


def test_cpu_parallel_threshold_follows_thread_count(monkeypatch):
    from blendmatch.gpu import cpu

    monkeypatch.setattr(cpu.numba, "get_num_threads", lambda: 2)
    assert cpu.CpuEngine().parallel_min_windows == cpu.PARALLEL_MIN_WINDOWS
    monkeypatch.setattr(cpu.numba, "get_num_threads", lambda: 16)
    assert cpu.CpuEngine().parallel_min_windows == cpu.PARALLEL_MIN_WINDOWS_MANY_THREADS
    assert cpu.CpuEngine(parallel_min_windows=7).parallel_min_windows == 7
    with pytest.raises(ValueError, match="parallel_min_windows"):
        cpu.CpuEngine(parallel_min_windows=-1)


def test_per_position_rule_on_repeated_content_matches_the_oracle(engine, rng):
    """LMCache's per-position rule through every engine: content stored under several
    hashes, queried with several copies of it; answers equal the oracle's, bit for bit."""
    from oracle import OracleIndex

    c = 8
    idx = BlendIndex(chunk_size=c, probe_stride=1, engine=engine)
    oracle = OracleIndex(c)
    chunks = rng.integers(0, 5, size=(4, c), dtype=np.uint32)
    for i in range(12):  # 3 hashes per content
        for target in (idx, oracle):
            target.add(chunks[i % 4], b"h%d" % i, i, NS)
    queries = [(np.concatenate([chunks[int(j)] for j in rng.integers(0, 4, size=9)]), NS) for _ in range(6)]
    queries.append((np.tile(chunks[0], 5), NS))
    got = idx.match_batch(queries)
    assert got == [oracle.match(q, ns) for q, ns in queries]
    assert [m.chunk_hash for m in got[-1]] == [b"h0", b"h4", b"h8"]  # then nothing: every hash seen
    for matches in got:
        assert len({m.cur_st for m in matches}) == len(matches) == len({m.chunk_hash for m in matches})


def test_cpu_engine_reads_the_occupancy_bits():
    """The CPU engine skips the table for slots its bits call empty (that is its speed), so
    it must be handed the bits of the same table: words that do not fit are refused."""
    from blendmatch.gpu import QueryBatch, cpu
    from blendmatch.gpu.occupancy import occupancy_words

    class Source:  # a table where every slot says "shared": every window survives
        def __init__(self, words_for):
            self.table = np.full(1024, 255, dtype=np.uint8)
            self.filter_arrays = (self.table, words_for(self.table))

    batch = QueryBatch.from_queries([np.arange(40, dtype=np.uint32)], window=8, stride=1)
    eng = cpu.CpuEngine(parallel_min_windows=0)
    assert len(eng.probe(batch, Source(occupancy_words))) == 33
    assert len(eng.probe(batch, Source(lambda t: np.zeros(16, np.uint64)))) == 0  # bits win
    with pytest.raises(ValueError, match="occupancy words"):
        eng.probe(batch, Source(lambda t: np.zeros(8, np.uint64)))


def test_each_cached_kernel_has_its_own_python_function():
    """numba's disk cache is keyed by the Python function, not by the compile flags: two
    cached dispatchers of one function load one entry (this made the "parallel" probe run the
    serial code). Every cached dispatcher in the engine and index modules must be distinct."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    import blendmatch.gpu
    import blendmatch.index

    seen: dict[object, tuple[Dispatcher, str]] = {}
    for pkg in (blendmatch.gpu, blendmatch.index):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("cupy_engine"):
                continue
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                if isinstance(obj, Dispatcher) and obj._cache.__class__.__name__ != "NullCache":
                    first, where = seen.setdefault(obj.py_func, (obj, f"{info.name}.{name}"))
                    assert first is obj, (f"{info.name}.{name} and {where} compile one Python function "
                                          "with the disk cache")
    assert len(seen) > 5
