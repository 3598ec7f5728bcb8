"""The defects a line-by-line review of the GPU path found (issue 27), one test (or more) each.

Each test failed on the code before the fix. The GPU engine runs on ``tests/fake_cupy.py``:
its kernels are the real CUDA text run as emulated host C++, device-to-host copies land
only at synchronisation, and memory comes from pools with a device budget.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from blendmatch.gpu import cupy_engine
from blendmatch.gpu import select as gpu_select
from blendmatch.gpu import xp_probe
from blendmatch.gpu.batch import QueryBatch
from blendmatch.gpu.engine import EngineBroken, EngineFailure, EngineOutOfMemory
from blendmatch.gpu.fingerprint import power_tables, prefix_fingerprints, slots_and_tags
from blendmatch.gpu.reference import ReferenceEngine
from blendmatch.gpu.xp_probe import TrialSlots, XpEngine, split_batch

from test_gpu_engine import assert_same, fake_device, make_case  # noqa: F401 - fake_device is a fixture

REF = ReferenceEngine(reason="oracle")
ROOT = Path(__file__).resolve().parents[1]


def planted(queries: list[np.ndarray], c: int, every: int = 7, size: int = 1 << 16) -> TrialSlots:
    """A slot table where every ``every``-th window of the batch survives."""
    table = np.zeros(size, np.uint8)
    for q in queries:
        if q.size < c:
            continue
        fw, bw = power_tables(q.size + 1)
        h = prefix_fingerprints(q, c, np, fw, bw)[: q.size - c + 1]
        slot, tag = slots_and_tags(h[::every], size - 1)
        table[slot] = tag
    return TrialSlots(table)


def long_batch(n_tokens: int, c: int = 16, stride: int = 1, seed: int = 5) -> tuple[QueryBatch, TrialSlots]:
    rng = np.random.default_rng(seed)
    qs = [rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
          for n in (n_tokens // 2, 17, n_tokens - n_tokens // 2 - 17)]
    return QueryBatch.from_queries(qs, c, stride), planted(qs, c)


# --------------------------------------------------------------------------------------
# 1. FailoverEngine must answer every batch in flight at the moment of failover
# --------------------------------------------------------------------------------------
def test_failover_answers_every_batch_in_flight_on_the_cpu():
    rng = np.random.default_rng(1)
    batch, slots = make_case(rng, c=8, stride=1, max_len=400)
    while batch.num_windows() == 0:
        batch, slots = make_case(rng, c=8, stride=1, max_len=400)
    want = REF.probe(batch, slots)

    class FailsForBoth:
        """Two batches in flight; both fail, the second only after the first failed over."""

        name, reason = "gpu", "test"

        def __init__(self) -> None:
            self.entered = threading.Barrier(2)
            self.lock = threading.Lock()
            self.calls = 0
            self.closed = False

        def probe(self, batch, slots):
            self.entered.wait(timeout=60)
            with self.lock:
                i = self.calls
                self.calls += 1
            if i == 1:
                for _ in range(60_000):  # bounded: until the other thread has failed over
                    if wrapper.failovers:
                        break
                    time.sleep(0.001)
            raise EngineFailure(f"simulated lost device (call {i})")

        def close(self) -> None:
            self.closed = True

    broken = FailsForBoth()
    wrapper = gpu_select.FailoverEngine(broken)
    results: list = [None, None]

    def worker(k: int) -> None:
        try:
            results[k] = wrapper.probe(batch, slots)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results[k] = exc

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert not isinstance(r, BaseException), f"a batch in flight was dropped: {r!r}"
        assert_same(r, want)
    assert wrapper.failovers == 1 and wrapper.name == "cpu" and broken.closed


def test_failure_of_the_cpu_engine_moved_to_is_not_retried():
    class Broken:
        name, reason = "gpu", "test"

        def probe(self, batch, slots):
            raise EngineFailure("lost")

        def close(self):
            pass

    wrapper = gpu_select.FailoverEngine(Broken())
    batch = QueryBatch.from_queries([np.arange(40, dtype=np.uint32)], 8, 1)
    slots = TrialSlots(np.zeros(1024, np.uint8))
    assert len(wrapper.probe(batch, slots)) == 0 and wrapper.name == "cpu"

    class CpuFails:
        name, reason = "cpu", "x"

        def probe(self, batch, slots):
            raise EngineFailure("cpu broke")

        def close(self):
            pass

    wrapper._active = wrapper._fallback = CpuFails()
    with pytest.raises(EngineFailure, match="cpu broke"):
        wrapper.probe(batch, slots)
    assert wrapper.failovers == 1


# --------------------------------------------------------------------------------------
# 2. out-of-memory is memory pressure, not a broken device
# --------------------------------------------------------------------------------------
def _peak_of(fake, eng, batch, slots) -> int:
    eng._free_memory()
    base = fake.DEVICE.held()
    fake.DEVICE.peak = base
    eng.probe(batch, slots)
    return fake.DEVICE.peak - base


def test_out_of_memory_frees_and_splits_instead_of_failing_over(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test")
    wrapper = gpu_select.FailoverEngine(eng)
    try:
        batch, slots = long_batch(120_000)
        half, _ = long_batch(60_000)
        want = REF.probe(batch, slots)
        full_peak = _peak_of(fake_device, eng, batch, slots)
        half_peak = _peak_of(fake_device, eng, half, slots)
        assert half_peak < full_peak
        eng._free_memory()
        fake_device.DEVICE.limit = fake_device.DEVICE.held() + (full_peak + half_peak) // 2
        got = wrapper.probe(batch, slots)
        assert_same(got, want)
        assert wrapper.failovers == 0 and wrapper.name == "gpu"  # still on the device
        assert eng.oom_retries >= 1 and eng.split_batches >= 1
        fake_device.DEVICE.limit = None
        before = eng.device_batches
        assert_same(wrapper.probe(batch, slots), want)
        assert eng.device_batches > before
    finally:
        wrapper.close()


def test_persistent_out_of_memory_answers_on_the_cpu_and_keeps_the_gpu(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test")
    wrapper = gpu_select.FailoverEngine(eng)
    try:
        batch, slots = long_batch(30_000)
        want = REF.probe(batch, slots)
        eng._free_memory()
        fake_device.DEVICE.limit = fake_device.DEVICE.held() + 4096  # nothing fits
        assert_same(wrapper.probe(batch, slots), want)  # answered on the CPU
        assert wrapper.failovers == 0 and wrapper.name == "gpu" and wrapper.memory_fallbacks == 1
        assert eng.oom_retries >= 2
        with pytest.raises(EngineOutOfMemory, match="out of memory"):
            eng.probe(batch, slots)
        fake_device.DEVICE.limit = None
        before = eng.device_batches
        assert_same(wrapper.probe(batch, slots), want)  # back on the device
        assert eng.device_batches > before and wrapper.memory_fallbacks == 1
    finally:
        wrapper.close()


def test_other_device_errors_still_fail_over(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test")
    wrapper = gpu_select.FailoverEngine(eng)
    batch, slots = long_batch(5000)
    fake_device.RawModule.instances[-1].fail_next = True
    assert_same(wrapper.probe(batch, slots), REF.probe(batch, slots))
    assert wrapper.failovers == 1 and wrapper.name == "cpu" and getattr(eng, "oom_retries", 0) == 0


def test_xp_engine_retries_memory_errors_in_smaller_passes():
    class Tight(XpEngine):
        def _run(self, batch, plan, slots):
            if batch.num_tokens > 5000:
                raise MemoryError("simulated: cannot allocate")
            return super()._run(batch, plan, slots)

    eng = Tight(np)
    batch, slots = long_batch(20_000)
    assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
    assert eng.oom_retries >= 2 and eng.split_batches >= 1 and eng.failures == 0


# --------------------------------------------------------------------------------------
# 3. batches at or past CuPy's int scan length
# --------------------------------------------------------------------------------------
def test_batches_past_the_scan_limit_run_in_passes(fake_device, monkeypatch):
    monkeypatch.setattr(xp_probe, "SCAN_LIMIT", 8000, raising=False)
    eng = gpu_select.create_gpu_engine(reason="test")
    try:
        fake_device.DEVICE.scan_int_max = 8000  # the fake device's scans now break at 8000, like CuPy's at 2^31
        for stride in (1, 3, 16):
            batch, slots = long_batch(30_000, stride=stride)
            assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
        assert eng.max_pass_tokens == 8000 and eng.split_batches >= 3
    finally:
        eng.close()


def test_split_batch_covers_every_window_once():
    rng = np.random.default_rng(3)
    for _ in range(150):
        batch, slots = make_case(rng, max_len=400)
        want = REF.probe(batch, slots)
        cap = int(rng.integers(1, 300))
        pieces = split_batch(batch, cap)
        floor = batch.window + batch.stride
        assert all(p.num_tokens <= max(cap, floor) for p, _, _ in pieces)
        eng = XpEngine(np, max_pass_tokens=cap)
        assert_same(eng.probe(batch, slots), want)


def test_max_batch_tokens_is_bounded_with_a_clear_error():
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from blendmatch.service.config import ServiceConfig

    assert ServiceConfig(max_batch_tokens=2**31 - 1).max_batch_tokens == 2**31 - 1
    with pytest.raises(ValidationError, match="max_batch_tokens"):
        ServiceConfig(max_batch_tokens=2**31)


# --------------------------------------------------------------------------------------
# 4. the output is sized by the survivors, not by the windows
# --------------------------------------------------------------------------------------
def test_output_buffer_is_sized_by_survivors(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test")
    try:
        rng = np.random.default_rng(4)
        q = rng.integers(0, 2**32, size=(1 << 17) - 1, dtype=np.uint64).astype(np.uint32)
        batch = QueryBatch.from_queries([q], 16, 1)
        slots = planted([q], 16, every=1000)
        fake_device.DEVICE.allocations.clear()
        got = eng.probe(batch, slots)
        assert_same(got, REF.probe(batch, slots))
        w = batch.num_windows()
        assert 0 < len(got) < w // 500
        biggest = max(fake_device.DEVICE.allocations)
        assert biggest < 16 * w, f"an allocation of {biggest} bytes for {w} windows ({biggest / w:.0f} B/window)"
    finally:
        eng.close()


# --------------------------------------------------------------------------------------
# 5. what the engine keeps between batches is bounded
# --------------------------------------------------------------------------------------
def test_memory_kept_between_batches_is_bounded(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test")
    try:
        eng.keep_bytes = 1 << 20
        batch, slots = long_batch(600_000)
        assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
        small, _ = long_batch(2000)
        eng.probe(small, slots)
        kept = fake_device.DEVICE.held() - slots.table.nbytes
        assert kept <= 3 * eng.keep_bytes, f"{kept} bytes kept on the device after the batches"
        assert eng.memory_stats()["pinned_bytes"] <= 2 * eng.keep_bytes
    finally:
        eng.close()


# --------------------------------------------------------------------------------------
# 6. the start-up self-test takes the large-batch paths
# --------------------------------------------------------------------------------------
def test_self_test_runs_grid_stride_iterations_pieces_and_passes(fake_device):
    eng = gpu_select.create_gpu_engine(reason="test")
    eng.close()
    flags = [(g, b, w) for name, g, b, w in fake_device.LAUNCHES.launches if name == "bm_flag_kernel"]
    assert any(w > 4 * g * b for g, b, w in flags), "no launch iterated its grid-stride loop"
    assert sum(1 for n in fake_device.DEVICE.h2d if n == 4096) >= 4, "no upload went in several pieces"
    assert max(w for _, _, w in flags) <= 1 << 14 and sum(w for _, _, w in flags) > 50_000


def test_self_test_refuses_a_kernel_that_skips_grid_stride_iterations(fake_device, monkeypatch):
    broken = cupy_engine.KERNEL_SOURCE.replace("w += step)\n        flag[w]", "w += 2 * step)\n        flag[w]")
    assert broken != cupy_engine.KERNEL_SOURCE
    monkeypatch.setattr(cupy_engine, "KERNEL_SOURCE", broken)
    with pytest.raises(gpu_select.GpuSelfTestError):
        gpu_select.create_gpu_engine(reason="test")


# --------------------------------------------------------------------------------------
# 7. a broken GPU is a WARNING that names the error; an import error is not "not installed"
# --------------------------------------------------------------------------------------
def test_installed_cupy_that_fails_to_import_says_what_failed(tmp_path, monkeypatch):
    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libnvrtc.so.12: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    importlib.invalidate_caches()
    why = cupy_engine.gpu_unavailable()
    assert isinstance(why, EngineBroken)
    assert "not installed" not in str(why) and "libnvrtc.so.12" in str(why) and "failed to import" in str(why)


def test_a_gpu_engine_that_breaks_is_logged_at_warning(fake_device, monkeypatch, caplog):
    monkeypatch.setattr(cupy_engine, "KERNEL_SOURCE", cupy_engine.KERNEL_SOURCE.replace("bm_u64 m =", "bm_u64 m = ="))
    with caplog.at_level(logging.INFO, logger="blendmatch.gpu"):
        eng = gpu_select.select_engine("auto")
    assert eng.name == "cpu" and "failed its trial" in eng.reason
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "host C++ build of the kernels failed" in warned[0].getMessage()


def test_no_cupy_is_logged_at_info(monkeypatch, caplog):
    def no_cupy():
        raise cupy_engine.EngineUnavailable("CuPy is not installed (simulated)")

    monkeypatch.setattr(cupy_engine, "_import_cupy", no_cupy)
    with caplog.at_level(logging.INFO, logger="blendmatch.gpu"):
        assert gpu_select.select_engine("auto").name == "cpu"
    assert [r.levelno for r in caplog.records if "not installed" in r.getMessage()] == [logging.INFO]


# --------------------------------------------------------------------------------------
# 8. synchronisations per pass: one (fused), two (array), and the fake device makes each necessary
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["fused", "array"])
def test_synchronisations_per_pass(fake_device, kernels):
    eng = gpu_select.create_gpu_engine(reason="test", kernels=kernels)
    try:
        rng = np.random.default_rng(8)
        for _ in range(10):
            batch, slots = make_case(rng, c=8, stride=1, max_len=600)
            if batch.num_windows() == 0:
                continue
            fake_device.SYNCS[0] = 0
            overflows = eng.overflows
            assert_same(eng.probe(batch, slots), REF.probe(batch, slots))
            # fused: the copy-back's last event only (plus one when the survivors overflowed the
            # rows copied back before the count was known); array: the count, then the copy-back
            want = 1 + eng.overflows - overflows if kernels == "fused" else 2
            assert fake_device.SYNCS[0] == want
    finally:
        eng.close()


@pytest.mark.parametrize("kernels", ["fused", "array"])
def test_strict_streams_catch_a_missing_synchronisation(fake_device, kernels):
    eng = gpu_select.create_gpu_engine(reason="test", kernels=kernels)
    try:
        batch, slots = long_batch(3000)
        want = REF.probe(batch, slots)
        assert_same(eng.probe(batch, slots), want)
        eng._stream.synchronize = lambda: None  # the engine's host synchronisations deleted
        for slot in eng._slots:
            slot.ev["done"].synchronize = lambda: None
        other, other_slots = long_batch(3000, seed=6)  # other survivors: stale rows would show
        want = REF.probe(other, other_slots)
        assert len(want)
        try:
            got = eng.probe(other, other_slots)
        except EngineFailure:
            return
        assert not got.same_as(want)
    finally:
        eng.close()


# --------------------------------------------------------------------------------------
# 9. the GPU extras bring NVRTC
# --------------------------------------------------------------------------------------
def test_gpu_extras_bring_nvrtc():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, major in (("gpu-cuda12", "12"), ("gpu-cuda13", "13")):
        reqs = [Requirement(r) for r in extras[name]]
        cupy = [r for r in reqs if r.name == f"cupy-cuda{major}x"]
        assert cupy, f"{name} has no cupy-cuda{major}x"
        ctk = "ctk" in cupy[0].extras and all(Version("14") <= Version(s.version) for s in cupy[0].specifier
                                               if s.operator in (">=", "=="))
        nvrtc = any(r.name in (f"nvidia-cuda-nvrtc-cu{major}", "nvidia-cuda-nvrtc") for r in reqs)
        assert ctk or nvrtc, f"{name} gives no NVRTC: {extras[name]}"
