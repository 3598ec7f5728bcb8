"""The GPU engine, tested three ways.

- Always (CPU): the GPU engine's array algorithm and slot mirror as ``XpEngine(numpy)``
  against the reference and CPU engines on random batches (batch boundaries, strides > 1,
  shared/stale slots, change logs and rebuilds between batches); the mirror's patch logic
  (dedupe-last-write, trimmed logs, another source, writes racing a full upload); run-time
  error wrapping with a failing fake ``xp``; staging layout; the trial self-test.
- With a host C compiler (CI has one): the fused kernels' CUDA source, compiled as C, run
  per window against numpy and the reference (the device kernels' exact text).
- With a GPU (``-m gpu``; skipped with the reason otherwise): the device engine in both kernel
  modes against the reference bit for bit, asserting the device path really ran.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import threading
import types

import numpy as np
import pytest

from engines import gpu_engine_or_skip, gpu_skip_reason

from blendmatch.gpu import cupy_engine
from blendmatch.gpu import select as gpu_select
from blendmatch.gpu.batch import Candidates, QueryBatch
from blendmatch.gpu.cpu import CpuEngine
from blendmatch.gpu.engine import EngineFailure, EngineOutOfMemory, EngineUnavailable
from blendmatch.gpu.select import select_engine
from blendmatch.gpu.reference import ReferenceEngine
from blendmatch.gpu.xp_probe import (
    TIMING_KEYS,
    ArrayProbe,
    SlotMirror,
    TrialSlots,
    XpEngine,
    create_xp_engine,
    dedupe_last_write,
    plan_windows,
    rows_to_candidates,
    stage_upload,
    staging_layout,
    staging_views,
)
from blendmatch.gpu.fingerprint import power_tables, prefix_fingerprints, rolling_fingerprints, slots_and_tags
from blendmatch.index.slots import SlotArray

REF = ReferenceEngine(reason="oracle")


# --------------------------------------------------------------------------------------
# random cases
# --------------------------------------------------------------------------------------
def _windows_fps(tokens: np.ndarray, c: int) -> np.ndarray:
    return rolling_fingerprints(tokens, c) if tokens.size >= c else np.zeros(0, np.uint64)


def make_case(rng: np.random.Generator, *, filter: str = "tagged", max_len: int = 300,
              c: int | None = None, stride: int | None = None) -> tuple[QueryBatch, SlotArray]:
    """A random batch and a slot array with planted hits, straddling decoys and shared slots."""
    c = int(c if c is not None else rng.choice([1, 2, 3, 8, 16, 32]))
    stride = int(stride if stride is not None else rng.choice([1, 1, 2, 3, c, c + 1, 2 * c + 1]))
    vocab = int(rng.choice([3, 50, 2**32]))  # tiny vocabularies repeat windows; 2^32 hits the top ids
    lengths = [int(x) for x in rng.choice([0, max(c - 1, 0), c, c + 1, c + stride, int(rng.integers(0, max_len + 1))],
                                          size=int(rng.integers(0, 8)))]
    lengths += [int(rng.integers(0, max_len + 1)) for _ in range(int(rng.integers(0, 4)))]
    rng.shuffle(lengths)
    queries = [rng.integers(0, vocab, size=n, dtype=np.uint64).astype(np.uint32) for n in lengths]
    if len(queries) >= 2 and queries[0].size >= c and queries[-1].size >= c:
        queries[-1][:c] = queries[0][:c]  # the same window content in two queries
    batch = QueryBatch.from_queries(queries, c, stride)
    slots = SlotArray(filter=filter, min_size=1024)
    planted = [f[rng.random(f.size) < 0.15] for f in (_windows_fps(q, c) for q in queries)]
    # decoys: windows of the concatenated batch, many straddling two queries (never valid)
    decoys = _windows_fps(batch.tokens, c)
    decoys = decoys[rng.random(decoys.size) < 0.1]
    noise = rng.integers(0, 2**64, size=int(rng.integers(0, 200)), dtype=np.uint64)
    fps = np.unique(np.concatenate(planted + [decoys, noise]))
    slots.insert(fps)
    if fps.size:  # removals: tagged slots clear, shared ones go stale (stay 255)
        slots.remove(fps[rng.random(fps.size) < 0.1])
    return batch, slots


def assert_same(got: Candidates, want: Candidates) -> None:
    assert got.windows == want.windows
    assert got.query_index.dtype == np.int64 and got.cur_st.dtype == np.int64
    assert got.fingerprint.dtype == np.uint64
    np.testing.assert_array_equal(got.query_index, want.query_index)
    np.testing.assert_array_equal(got.cur_st, want.cur_st)
    np.testing.assert_array_equal(got.fingerprint, want.fingerprint)


# --------------------------------------------------------------------------------------
# the array algorithm on numpy
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("filter", ["tagged", "occupancy"])
def test_xp_numpy_matches_reference_and_cpu_on_random_batches(filter):
    rng = np.random.default_rng(2024)
    xp_engine, cpu = XpEngine(np), CpuEngine(reason="test")
    survivors = 0
    for _ in range(60):
        batch, slots = make_case(rng, filter=filter)
        want = REF.probe(batch, slots)
        assert_same(xp_engine.probe(batch, slots), want)
        assert_same(cpu.probe(batch, slots), want)
        survivors += len(want)
    assert survivors > 100  # the cases really exercise survivors, not just empty answers


def test_every_registered_engine_on_the_gpu_engines_edge_cases(engine):
    """Conformance over tests/engines.py (xp-numpy always; gpu/gpu-array where a GPU answers):
    batch boundaries with straddling decoys, strides around the window, shared/stale slots."""
    rng = np.random.default_rng(606)
    for i in range(25):
        batch, slots = make_case(rng, filter="occupancy" if i % 5 == 4 else "tagged")
        assert_same(engine.probe(batch, slots), REF.probe(batch, slots))


def test_plan_windows_matches_count_windows():
    rng = np.random.default_rng(5)
    for _ in range(200):
        batch, _ = make_case(rng, max_len=60)
        plan = plan_windows(batch)
        assert plan.windows == batch.num_windows()
        assert plan.wbase[0] == 0 and plan.wbase[-1] == plan.windows
        assert np.all(np.diff(plan.wbase) >= 0)
        np.testing.assert_array_equal(plan.qstart, batch.offsets[:-1])


def test_coordinates_skip_queries_without_windows():
    # queries of lengths 2, 6, 0, 3 with C=2, stride 1: window counts 1, 5, 0, 2
    qs = [np.arange(n, dtype=np.uint32) for n in (2, 6, 0, 3)]
    batch = QueryBatch.from_queries(qs, 2, 1)
    plan = plan_windows(batch)
    np.testing.assert_array_equal(plan.wbase, [0, 1, 6, 6, 8])
    q, cur, start = ArrayProbe(np).coordinates(plan.wbase, plan.qstart, plan.windows, plan.stride)
    np.testing.assert_array_equal(q, [0, 1, 1, 1, 1, 1, 3, 3])
    np.testing.assert_array_equal(cur, [0, 0, 1, 2, 3, 4, 0, 1])
    np.testing.assert_array_equal(start, [0, 2, 3, 4, 5, 6, 8, 9])


def test_compaction_keeps_window_order():
    probe = ArrayProbe(np)
    keep = np.array([0, 1, 1, 0, 0, 1, 0, 1], dtype=bool)
    q = np.arange(8, dtype=np.int64) // 3
    cur = np.arange(8, dtype=np.int64) * 5
    fp = np.arange(8, dtype=np.uint64) + np.uint64(2**63)
    rows = probe.compact_rows(keep, q, cur, fp)
    np.testing.assert_array_equal(rows[:, 0], q[keep])
    np.testing.assert_array_equal(rows[:, 1], cur[keep])
    np.testing.assert_array_equal(rows[:, 2], fp[keep])
    assert probe.compact_rows(np.zeros(5, bool), q[:5], cur[:5], fp[:5]).shape == (0, 3)


def test_empty_and_short_batches():
    eng = XpEngine(np)
    slots = SlotArray()
    for queries, c in [([], 4), ([np.zeros(0, np.uint32)], 4), ([np.arange(3, dtype=np.uint32)] * 3, 4)]:
        batch = QueryBatch.from_queries(queries, c, 1)
        got = eng.probe(batch, slots)
        assert len(got) == 0 and got.windows == 0
        assert_same(got, REF.probe(batch, slots))


def test_rows_to_candidates_copies_out_of_the_staging_buffer():
    rows = np.array([[1, 2, 3], [4, 5, 2**64 - 1]], dtype=np.uint64)
    c = rows_to_candidates(rows, 9, {"kernels_s": 1.0})
    rows[:] = 0  # the pinned buffer is reused by the next batch
    np.testing.assert_array_equal(c.query_index, [1, 4])
    np.testing.assert_array_equal(c.cur_st, [2, 5])
    np.testing.assert_array_equal(c.fingerprint, np.array([3, 2**64 - 1], dtype=np.uint64))
    assert c.windows == 9 and c.timings == {"kernels_s": 1.0}
    assert c.query_index.flags.c_contiguous and c.fingerprint.flags.c_contiguous


def test_timings_are_filled():
    rng = np.random.default_rng(1)
    batch, slots = make_case(rng, c=8, stride=1)
    got = XpEngine(np).probe(batch, slots)
    for key in TIMING_KEYS:
        assert key in got.timings and got.timings[key] >= 0


def test_thread_safety():
    rng = np.random.default_rng(9)
    cases = [make_case(rng, c=8) for _ in range(8)]
    wants = [REF.probe(b, s) for b, s in cases]
    _probe_from_threads(XpEngine(np), cases, wants, rounds=20)


def _probe_from_threads(eng, cases, wants, rounds: int, threads: int = 4) -> None:
    """Four threads probe the same engine concurrently; every answer must be the reference's."""
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(rounds):
                j = (i + k) % len(cases)
                assert eng.probe(*cases[j]).same_as(wants[j])
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors


# --------------------------------------------------------------------------------------
# the slot mirror (numpy plays the device)
# --------------------------------------------------------------------------------------
def test_dedupe_last_write():
    s, v = dedupe_last_write(np.array([5, 1, 5, 3, 1, 5]), np.array([10, 11, 12, 13, 14, 15]))
    np.testing.assert_array_equal(s, [1, 3, 5])
    np.testing.assert_array_equal(v, [14, 13, 15])
    rng = np.random.default_rng(3)
    for _ in range(50):
        slots = rng.integers(0, 40, size=int(rng.integers(0, 100)))
        vals = rng.integers(0, 256, size=slots.size).astype(np.uint8)
        want = np.zeros(40, np.uint8)
        for a, b in zip(slots, vals):  # the log, applied in order
            want[a] = b
        got = np.zeros(40, np.uint8)
        us, uv = dedupe_last_write(slots, vals)
        assert np.all(np.diff(us) > 0)
        got[us] = uv
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        dedupe_last_write(np.arange(3), np.arange(2))


def test_mirror_follows_change_log_and_rebuilds():
    rng = np.random.default_rng(11)
    batch, slots = make_case(rng, c=8, stride=1)
    eng = XpEngine(np)
    mirror = eng._mirror
    assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
    assert eng.stats()["full_uploads"] == 1
    assert mirror.table is not slots.table  # a copy, changed only through the log

    # a change log between batches: inserts and removals -> one patch
    before = slots.version
    extra = rng.integers(0, 2**64, size=50, dtype=np.uint64)
    slots.insert(extra)
    slots.remove(extra[:25])
    assert slots.version > before
    assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
    st = eng.stats()
    assert st["full_uploads"] == 1 and st["patches"] == 1
    np.testing.assert_array_equal(mirror.table, slots.table)

    # nothing changed: no upload, no patch
    eng.probe(batch, slots)
    assert eng.stats()["patches"] == 1 and eng.stats()["full_uploads"] == 1

    # a rebuild between batches (new generation, new size) -> a full upload
    window_fps = np.unique(_windows_fps(batch.tokens, 8))
    slots.rebuild(np.union1d(extra[25:], window_fps[::2]), size=4096)
    assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
    assert eng.stats()["full_uploads"] == 2
    np.testing.assert_array_equal(mirror.table, slots.table)


def test_mirror_trimmed_log_means_full_upload():
    slots = SlotArray(min_size=1 << 15)
    mirror = SlotMirror(np)
    assert mirror.sync(slots) == "full"
    rng = np.random.default_rng(4)
    fps = rng.integers(0, 2**64, size=12000, dtype=np.uint64)  # > size/4 log entries -> trimmed
    slots.insert(fps)
    assert mirror.sync(slots) == "full"
    np.testing.assert_array_equal(mirror.table, slots.table)
    slots.remove(fps[:10])
    assert mirror.sync(slots) == "patch"
    assert mirror.sync(slots) == "current"
    np.testing.assert_array_equal(mirror.table, slots.table)


def test_mirror_is_not_confused_by_another_source():
    rng = np.random.default_rng(8)
    batch, _ = make_case(rng, c=4, stride=1)
    a, b = SlotArray(), SlotArray()
    fps = _windows_fps(batch.tokens, 4)
    a.insert(np.unique(fps[: fps.size // 2]))
    b.insert(np.unique(fps[fps.size // 2:]) if fps.size else fps)
    eng = XpEngine(np)
    for src in (a, b, a):  # equal (generation, version) is not enough: it is another table
        assert_same(eng.probe(batch, src), REF.probe(batch, src))


def test_mirror_converges_when_writes_race_a_full_upload():
    """A full upload copies the live table; writes landing during the copy are in the log
    after the reported version and are applied again by the next sync (last write wins)."""
    slots = TrialSlots(np.zeros(1024, np.uint8))
    slots.write(np.array([1, 2, 3]), np.array([7, 8, 9]))
    v_before = slots.version
    slots.write(np.array([2, 4, 2]), np.array([0, 255, 5]))  # "during" the upload

    class Racing:  # reports the older version with the newer table, like a racing copy
        table = slots.table
        generation = slots.generation

        def __init__(self) -> None:
            self.first = True

        def changes_since(self, g, v):
            if self.first:
                self.first = False
                return TrialSlots.Changes(slots.generation, v_before, True, slots.table,
                                          np.zeros(0, np.int64), np.zeros(0, np.uint8))
            return slots.changes_since(g, v)

    src = Racing()
    mirror = SlotMirror(np)
    assert mirror.sync(src) == "full" and mirror.version == v_before
    assert mirror.sync(src) == "patch"
    np.testing.assert_array_equal(mirror.table, slots.table)
    assert mirror.table[2] == 5 and mirror.table[4] == 255


def test_mirror_rejects_a_log_outside_the_table():
    slots = TrialSlots(np.zeros(1024, np.uint8))
    mirror = SlotMirror(np)
    mirror.sync(slots)
    slots._log_s.append(np.array([5000]))  # a corrupt log entry
    slots._log_v.append(np.array([1], np.uint8))
    slots.version += 1
    with pytest.raises(ValueError, match="outside"):
        mirror.sync(slots)


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------
class FakeDeviceError(RuntimeError):
    """What a device error looks like to the engine (e.g. CuPy's OutOfMemoryError)."""


class FlakyNumpy(types.SimpleNamespace):
    """numpy, except that ``cumsum`` raises while ``armed`` (a failing device)."""

    __name__ = "flaky"

    def __init__(self) -> None:
        super().__init__(armed=False)

    def __getattr__(self, name):
        return getattr(np, name)

    def cumsum(self, *args, **kwargs):
        if self.armed:
            raise FakeDeviceError("simulated: out of memory allocating 16777216 bytes")
        return np.cumsum(*args, **kwargs)


def test_run_time_errors_become_engine_failure_and_reset_the_mirror():
    rng = np.random.default_rng(12)
    batch, slots = make_case(rng, c=8, stride=2)
    xp = FlakyNumpy()
    eng = XpEngine(xp)
    assert eng.name == "xp-flaky"
    assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
    xp.armed = True
    with pytest.raises(EngineFailure, match="FakeDeviceError") as info:
        eng.probe(batch, slots)
    assert isinstance(info.value.__cause__, FakeDeviceError)
    assert eng.failures == 1 and eng._mirror.table is None
    xp.armed = False
    assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
    assert eng.stats()["full_uploads"] == 2  # re-uploaded after the failure


def test_bad_table_is_value_error_not_engine_failure():
    batch = QueryBatch.from_queries([np.arange(10, dtype=np.uint32)], 4, 1)
    for table in (np.zeros(1000, np.uint8), np.zeros(1024, np.int32), np.zeros((32, 32), np.uint8)):
        bad = types.SimpleNamespace(table=table, generation=0, version=0, mask=table.shape[0] - 1,
                                    changes_since=lambda g, v: None)
        with pytest.raises(ValueError, match="slot table"):
            XpEngine(np).probe(batch, bad)


def test_closed_engine_raises_engine_failure():
    eng = XpEngine(np)
    eng.close()
    eng.close()  # idempotent
    batch = QueryBatch.from_queries([np.arange(10, dtype=np.uint32)], 4, 1)
    with pytest.raises(EngineFailure, match="closed"):
        eng.probe(batch, SlotArray())


def test_xp_engine_factory():
    eng = create_xp_engine("numpy")
    assert eng.name == "xp-numpy" and eng.reason
    with pytest.raises(ValueError, match="torch"):
        create_xp_engine("torch")


# --------------------------------------------------------------------------------------
# staging (one upload: plan + tokens, piece by piece)
# --------------------------------------------------------------------------------------
def test_staging_roundtrip_piecewise():
    rng = np.random.default_rng(6)
    for _ in range(20):
        batch, _ = make_case(rng, max_len=200)
        plan = plan_windows(batch)
        nq, n = plan.num_queries, batch.num_tokens
        total = staging_layout(nq, n)[2]
        host = np.full(total + 13, 0xAB, np.uint8)
        device = np.zeros(total, np.uint8)
        covered = np.zeros(total, np.int64)

        def copy(offset: int, nbytes: int) -> None:
            device[offset:offset + nbytes] = host[offset:offset + nbytes]
            covered[offset:offset + nbytes] += 1

        assert stage_upload(host, plan, batch.tokens, copy, piece=64) == total
        assert np.all(covered == 1)  # every byte sent exactly once
        wbase, qstart, tokens = staging_views(device, nq, n)
        np.testing.assert_array_equal(wbase, plan.wbase)
        np.testing.assert_array_equal(qstart, plan.qstart)
        np.testing.assert_array_equal(tokens, batch.tokens)
    with pytest.raises(ValueError, match="too small"):
        stage_upload(np.zeros(4, np.uint8), plan, batch.tokens, copy)


# --------------------------------------------------------------------------------------
# the fused kernels' source (compiled by NVRTC in test_gpu_nvrtc.py, run as emulated host
# C++ under sanitizers in test_gpu_host_emulation.py)
# --------------------------------------------------------------------------------------
def test_kernel_source_carries_the_fingerprint_constants():
    from blendmatch.gpu import fingerprint as fp

    src = cupy_engine.KERNEL_SOURCE
    assert f"{int(fp.FMIX_C1):#x}ULL" in src and f"{int(fp.FMIX_C2):#x}ULL" in src
    assert "bm_flag_kernel" in src and "bm_scatter_kernel" in src


# --------------------------------------------------------------------------------------
# selection, trial launch, self-test (CPU side)
# --------------------------------------------------------------------------------------
def test_self_test_passes_on_cpu_engines_and_catches_a_wrong_engine():
    assert gpu_select.self_test(XpEngine(np)) > 0
    assert gpu_select.self_test(CpuEngine(reason="test")) > 0
    assert gpu_select.self_test(XpEngine(np), oracle=ReferenceEngine()) > 0

    class DropsLast:
        name = "drops-last"

        def probe(self, batch, slots):
            c = REF.probe(batch, slots)
            return Candidates(c.query_index[:-1], c.cur_st[:-1], c.fingerprint[:-1], c.windows)

    with pytest.raises(gpu_select.GpuSelfTestError, match="refusing"):
        gpu_select.self_test(DropsLast())


def test_gpu_selection_without_cupy(monkeypatch):
    def no_cupy():
        raise EngineUnavailable("CuPy is not installed (simulated); install it with pip install ...")

    monkeypatch.setattr(cupy_engine, "_import_cupy", no_cupy)
    assert "not installed" in cupy_engine.gpu_unavailable_reason()
    with pytest.raises(EngineUnavailable, match="not installed"):
        select_engine("gpu")
    auto = select_engine("auto")
    assert auto.name == "cpu" and "no usable GPU" in auto.reason and "not installed" in auto.reason


def test_missing_cupy_names_the_install_hint():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    why = cupy_engine.gpu_unavailable_reason()
    assert "pip install" in why and "gpu-cuda12" in why and "gpu-cuda13" in why


def test_bad_kernel_mode_is_value_error(monkeypatch):
    with pytest.raises(ValueError, match="kernels"):
        gpu_select.create_gpu_engine(kernels="magic")
    monkeypatch.setenv(cupy_engine.KERNELS_ENV, "magic")
    with pytest.raises(ValueError, match="kernels"):
        select_engine("gpu")


def test_bench_inputs_plant_hits():
    from blendmatch.bench import gpu_micro

    qs, slots = gpu_micro._bench_inputs(chunks=1000, queries=3, tokens=600, window=32, stride=1)
    assert slots.table.size == 16384
    batch = QueryBatch.from_queries(qs, 32, 1)
    got = CpuEngine(reason="test").probe(batch, slots)
    assert len(got) >= 3 * 32 * 0.9  # the planted windows (a few may share a fingerprint)
    assert_same(XpEngine(np).probe(batch, slots), got)


# --------------------------------------------------------------------------------------
# the GPU engine's Python side on a numpy-backed fake device (tests/fake_cupy.py)
# --------------------------------------------------------------------------------------
@pytest.fixture
def fake_device(monkeypatch):
    import cuda_host

    if cuda_host.cxx() is None:
        pytest.skip("no C++ compiler on this machine to build the kernel source for the fake device")
    import fake_cupy

    monkeypatch.setattr(cupy_engine, "_import_cupy", lambda: fake_cupy.cupy)
    monkeypatch.setattr(cupy_engine, "_import_cupyx", lambda: fake_cupy.cupyx)
    fake_cupy.reset()
    yield fake_cupy
    fake_cupy.reset()


def test_fake_device_parses_the_kernel_parameters():
    import cuda_host

    params = cuda_host.kernel_params(cupy_engine.KERNEL_SOURCE)
    assert sorted(params) == sorted(cupy_engine.KERNEL_NAMES)
    assert [p[0] for p in params["bm_flag_kernel"]] == ["H", "wbase", "qstart", "nq", "W", "stride", "table",
                                                        "mask", "flag"]


@pytest.mark.parametrize("kernels", ["fused", "array"])
def test_cupy_engine_on_fake_device_matches_reference(fake_device, kernels):
    eng = gpu_select.create_gpu_engine(reason="test", kernels=kernels)  # includes the self-test
    try:
        assert eng.name == "gpu" and eng.kernels == kernels and eng.device_name == "Fake numpy device"
        assert eng.batches == 0 and eng.stats()["full_uploads"] == 0  # trial state is reset
        module = fake_device.RawModule.instances[-1] if kernels == "fused" else None
        trial_launches = len(module.launches) if module is not None else 0
        rng = np.random.default_rng(31)
        for i in range(40):
            batch, slots = make_case(rng, filter="occupancy" if i % 5 == 4 else "tagged")
            got = eng.probe(batch, slots)
            assert_same(got, REF.probe(batch, slots))
            if batch.num_windows():
                assert set(TIMING_KEYS) <= set(got.timings)
        if module is not None:  # one flag and one scatter launch per pass, whatever the number of
            # queries (the scatter runs before the count is known), and one more scatter per overflow
            launches = module.launches[trial_launches:]
            assert launches.count("bm_scatter_kernel") == launches.count("bm_flag_kernel") + eng.overflows
            assert launches.count("bm_flag_kernel") == eng.device_batches > 0
        assert eng.device_batches == eng.batches > 0
    finally:
        eng.close()


@pytest.mark.parametrize("kernels", ["fused", "array"])
def test_cupy_engine_on_fake_device_follows_log_and_rebuild(fake_device, kernels):
    eng = gpu_select.create_gpu_engine(reason="test", kernels=kernels)
    try:
        rng = np.random.default_rng(32)
        batch, slots = make_case(rng, c=16, stride=3, max_len=3000)
        assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
        for step in range(4):
            extra = rng.integers(0, 2**64, size=40, dtype=np.uint64)
            slots.insert(extra)
            slots.remove(extra[: 5 + step])
            assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
        fps = np.unique(_windows_fps(batch.tokens, 16))
        slots.rebuild(fps[::2], size=2048)
        assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
        st = eng.stats()
        assert st["full_uploads"] == 2 and st["patches"] == 4
        np.testing.assert_array_equal(np.asarray(eng._mirror.table), slots.table)
    finally:
        eng.close()


def test_cupy_engine_on_fake_device_wraps_launch_failures(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test", kernels="fused")
    try:
        rng = np.random.default_rng(33)
        batch, slots = make_case(rng, c=8, stride=1, max_len=500)
        while batch.num_windows() == 0:
            batch, slots = make_case(rng, c=8, stride=1, max_len=500)
        want = REF.probe(batch, slots)
        fake_device.RawModule.instances[-1].fail_next = True
        with pytest.raises(EngineFailure, match="lost device") as info:
            eng.probe(batch, slots)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert eng._mirror.table is None and eng.failures == 1
        assert_same(eng.probe(batch, slots), want)
    finally:
        eng.close()
    with pytest.raises(EngineFailure, match="closed"):
        eng.probe(batch, slots)


def test_fake_device_checks_launch_arguments(fake_device):
    module = fake_device.cupy.RawModule(code=cupy_engine.KERNEL_SOURCE)
    k = module.get_function("bm_flag_kernel")
    h = fake_device.cupy.zeros(4, dtype=np.uint64)
    i = fake_device.cupy.zeros(2, dtype=np.int64)
    t = fake_device.cupy.zeros(1024, dtype=np.uint8)
    f = fake_device.cupy.zeros(4, dtype=np.uint8)
    with pytest.raises(TypeError, match="nq"):  # a Python int where an int64 scalar is due
        k((1,), (32,), (h, i, i[:1], 1, np.int64(1), np.int64(1), t, np.uint64(1023), f))
    with pytest.raises(TypeError, match="H"):  # int64 data where the fingerprints are uint64
        k((1,), (32,), (i, i, i[:1], np.int64(1), np.int64(1), np.int64(1), t, np.uint64(1023), f))


def test_create_gpu_engine_refuses_a_kernel_that_changes_answers(fake_device, monkeypatch):
    broken = cupy_engine.KERNEL_SOURCE.replace("v == tag ||", "v == tag + 1u ||")
    assert broken != cupy_engine.KERNEL_SOURCE
    monkeypatch.setattr(cupy_engine, "KERNEL_SOURCE", broken)
    with pytest.raises(gpu_select.GpuSelfTestError, match="refusing"):
        gpu_select.create_gpu_engine(reason="test", kernels="fused")
    auto = select_engine("auto")  # auto falls back to the CPU, saying why
    assert auto.name == "cpu" and "self-test" in auto.reason


def test_select_engine_on_fake_device(fake_device):
    for name in ("auto", "gpu"):
        eng = select_engine(name)
        try:
            assert eng.name == "gpu" and eng.reason
        finally:
            eng.close()


# --------------------------------------------------------------------------------------
# on the device (marked gpu; skipped with the reason where no GPU answers)
# --------------------------------------------------------------------------------------
@pytest.fixture(params=["fused", "array"])
def gpu_engine(request):
    eng = gpu_engine_or_skip(request.param)
    yield eng
    eng.close()


def _assert_ran_on_device(eng, batches_before: int) -> None:
    import cupy

    assert eng.name == "gpu"
    assert eng.device_batches > batches_before
    assert isinstance(eng._mirror.table, cupy.ndarray)


@pytest.mark.gpu
@pytest.mark.parametrize("filter", ["tagged", "occupancy"])
def test_gpu_matches_reference_on_random_batches(gpu_engine, filter):
    rng = np.random.default_rng(4242)
    survivors = 0
    for _ in range(40):
        batch, slots = make_case(rng, filter=filter)
        before = gpu_engine.device_batches
        got = gpu_engine.probe(batch, slots)
        assert_same(got, REF.probe(batch, slots))
        survivors += len(got)
        if batch.num_windows():
            _assert_ran_on_device(gpu_engine, before)
            assert got.timings["kernels_s"] >= 0 and got.timings["total_s"] > 0
    assert survivors > 50


@pytest.mark.gpu
def test_gpu_change_log_and_rebuild_between_batches(gpu_engine):
    rng = np.random.default_rng(99)
    batch, slots = make_case(rng, c=16, stride=1, max_len=2000)
    assert_same(gpu_engine.probe(batch, slots), REF.probe(batch, slots))
    fps = np.unique(_windows_fps(batch.tokens, 16))
    for step in range(6):  # inserts and removals through the log, probing between them
        extra = rng.integers(0, 2**64, size=40, dtype=np.uint64)
        slots.insert(extra)
        slots.remove(extra[: 10 + step])
        assert_same(gpu_engine.probe(batch, slots), REF.probe(batch, slots))
    assert gpu_engine.stats()["patches"] >= 6
    slots.rebuild(fps[::3], size=8192)  # rebuild between batches
    assert_same(gpu_engine.probe(batch, slots), REF.probe(batch, slots))
    slots.insert(np.setdiff1d(fps[1::3], fps[::3]))
    assert_same(gpu_engine.probe(batch, slots), REF.probe(batch, slots))
    st = gpu_engine.stats()  # initial + rebuild (+1 if the last insert outgrew the log and it was trimmed)
    assert 2 <= st["full_uploads"] <= 3 and st["device_batches"] >= 9


@pytest.mark.gpu
@pytest.mark.parametrize("stride", [1, 4, 256])
def test_gpu_large_batch_matches_cpu(gpu_engine, stride):
    from blendmatch.bench import gpu_micro

    qs, slots = gpu_micro._bench_inputs(chunks=200_000, queries=8, tokens=32_768, window=256, stride=stride)
    batch = QueryBatch.from_queries(qs, 256, stride)
    want = CpuEngine(reason="test").probe(batch, slots)
    got = gpu_engine.probe(batch, slots)
    assert len(want) > 0
    assert_same(got, want)
    _assert_ran_on_device(gpu_engine, 0)


def _memory_pressure_case(eng, pipelined: bool = False) -> None:
    """Memory pressure on the engine's own pool (issue 27's rule): a batch that does not fit
    in one pass runs in shorter passes on the device; one that fits in no pass is answered on
    the CPU by ``FailoverEngine``, which keeps the GPU; with the limit lifted the device
    answers again. The same body runs on the real device (``gpu``) and on the fake.

    (The first device run, 2026-12-04 on an H200, found the older form of this test limiting
    CuPy's *default* pool: the engine allocates from its own pool since issue 27, so nothing
    ran out and the test expected a failure that no longer exists.)

    ``pipelined``: every batch through ``probe_async(...).result()`` instead of ``probe``.
    """
    wrapper = gpu_select.FailoverEngine(eng)

    def run(engine, b, s):
        return engine.probe_async(b, s).result() if pipelined else engine.probe(b, s)

    pool = eng._pool
    try:
        rng = np.random.default_rng(9)
        qs = [rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32) for n in (60_000, 17, 59_983)]
        half_qs = [q[: q.size // 2] for q in qs]
        table = np.zeros(1 << 16, np.uint8)
        for q in qs:  # every 7th window of each query survives the probe
            fw, bw = power_tables(q.size + 1)
            h = prefix_fingerprints(q, 16, np, fw, bw)[: q.size - 15]
            slot, tag = slots_and_tags(h[::7], table.size - 1)
            table[slot] = tag
        slots = TrialSlots(table)
        batch = QueryBatch.from_queries(qs, 16, 1)
        half = QueryBatch.from_queries(half_qs, 16, 1)
        want = REF.probe(batch, slots)
        assert len(want) > 1000

        def peak(b: QueryBatch) -> int:
            eng._free_memory()
            eng.probe(b, slots)
            return int(pool.total_bytes())  # blocks stay cached (under keep_bytes): the pass's peak

        full_peak, half_peak = peak(batch), peak(half)
        assert half_peak < full_peak, (half_peak, full_peak)
        eng._free_memory()
        pool.set_limit(size=(full_peak + half_peak) // 2)
        try:
            assert_same(run(wrapper, batch, slots), want)
            assert wrapper.name == "gpu" and wrapper.failovers == 0 and wrapper.memory_fallbacks == 0
            assert eng.oom_retries >= 1 and eng.split_batches >= 1
            eng._free_memory()
            pool.set_limit(size=4096)  # no pass fits
            assert_same(run(wrapper, batch, slots), want)  # answered on the CPU
            assert wrapper.name == "gpu" and wrapper.failovers == 0 and wrapper.memory_fallbacks == 1
            with pytest.raises(EngineOutOfMemory, match="out of memory"):
                run(eng, batch, slots)
        finally:
            pool.set_limit(size=0)  # 0: no limit
        before = eng.device_batches
        assert_same(run(wrapper, batch, slots), want)  # back on the device, full upload
        assert eng.device_batches > before and wrapper.memory_fallbacks == 1 and wrapper.failovers == 0
    finally:
        wrapper.close()


@pytest.mark.gpu
@pytest.mark.parametrize("pipelined", [False, True])
def test_gpu_memory_pressure_splits_then_answers_on_the_cpu_and_keeps_the_gpu(pipelined):
    _memory_pressure_case(gpu_engine_or_skip("fused"), pipelined)


@pytest.mark.parametrize("pipelined", [False, True])
def test_memory_pressure_on_the_fake_device(fake_device, pipelined):
    """The body of the device test above, on the fake (its pools honour ``set_limit``),
    through ``probe`` and through the pipelined ``probe_async``."""
    _memory_pressure_case(gpu_select.create_gpu_engine(reason="test"), pipelined)


@pytest.mark.gpu
def test_gpu_concurrent_probes():
    eng = gpu_engine_or_skip("fused")
    try:
        rng = np.random.default_rng(5)
        cases = [make_case(rng, c=16) for _ in range(6)]
        wants = [REF.probe(b, s) for b, s in cases]
        _probe_from_threads(eng, cases, wants, rounds=10)
    finally:
        eng.close()


@pytest.mark.gpu
def test_select_engine_auto_picks_the_gpu():
    if gpu_skip_reason() is not None:
        gpu_engine_or_skip()  # skips (or fails under BLENDMATCH_REQUIRE_GPU=1) with the reason
    eng = select_engine("auto")
    try:
        assert eng.name == "gpu" and "trial launch" in eng.reason
    finally:
        eng.close()
