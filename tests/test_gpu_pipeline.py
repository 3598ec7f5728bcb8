"""The pipelined GPU engine (``CupyEngine.probe_async`` / ``gpu.engine.probe_many``), proven
on the strict fake device (``tests/fake_cupy.py``): its asynchronous copies land only when
the engine orders them with events or synchronises, fresh memory holds garbage, so a missing
event wait reads stale bytes. Answers are compared bit for bit with the numba CPU engine
across batch sizes, pipeline depths, pass splits, overflowing copy-backs, tokens decoded
straight into the lent pinned buffer, and a device failure in the middle of a pipelined run.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from blendmatch.gpu import select as gpu_select
from blendmatch.gpu.batch import QueryBatch
from blendmatch.gpu.cpu import CpuEngine
from blendmatch.gpu.engine import EngineFailure, ReadyProbe, is_pipelined, probe_async, probe_many
from blendmatch.gpu.reference import ReferenceEngine
from blendmatch.gpu.xp_probe import XpEngine
from blendmatch.index.slots import SlotArray

from test_gpu_engine import _windows_fps, assert_same, fake_device  # noqa: F401 - fake_device is a fixture

CPU = CpuEngine(reason="oracle")


def workload(seed: int, batches: int, *, c: int = 16, stride: int = 1, max_queries: int = 6,
             max_len: int = 900) -> tuple[list[QueryBatch], SlotArray]:
    """``batches`` random batches over one slot array holding about 1 in 6 of their windows
    (so every batch has survivors, some batches many)."""
    rng = np.random.default_rng(seed)
    out, fps = [], []
    for _ in range(batches):
        qs = [rng.integers(0, 60, size=int(rng.integers(0, max_len)), dtype=np.uint32)
              for _ in range(int(rng.integers(1, max_queries + 1)))]
        b = QueryBatch.from_queries(qs, c, stride)
        out.append(b)
        for q in qs:
            f = _windows_fps(q, c)
            fps.append(f[rng.random(f.size) < 1 / 6])
    slots = SlotArray(filter="tagged", min_size=1 << 14)
    slots.insert(np.unique(np.concatenate(fps)))
    return out, slots


def gpu(**kw):
    eng = gpu_select.create_gpu_engine(reason="test", kernels="fused")
    for k, v in kw.items():
        setattr(eng, k, v)
    return eng


# --------------------------------------------------------------------------------------
# the fake device itself is strict
# --------------------------------------------------------------------------------------
def test_fake_copies_land_only_when_an_event_orders_them(fake_device):
    cp, cupyx = fake_device.cupy, fake_device.cupyx
    up, compute = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    host = cupyx.empty_pinned((64,), dtype=np.uint8)
    host[:] = np.arange(64, dtype=np.uint8)
    dev = cp.empty((64,), dtype=cp.uint8)
    dev.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), 64, up)
    uploaded = cp.cuda.Event()
    uploaded.record(up)
    with compute:
        assert int(dev[3]) == 0xA5  # not ordered after the upload: garbage
    with compute:
        compute.wait_event(uploaded)
        assert int(dev[3]) == 3  # ordered: the upload ran first
    back = cupyx.empty_pinned((64,), dtype=np.uint8)
    dev.data.copy_to_host_async(ctypes.c_void_p(back.ctypes.data), 64, compute)
    done = cp.cuda.Event()
    done.record(compute)
    assert back[5] == 0xCD  # not waited for: the host sees garbage
    done.synchronize()
    assert back[5] == 5
    with pytest.raises(TypeError, match="pinned"):
        dev.data.copy_from_host_async(ctypes.c_void_p(np.zeros(64, np.uint8).ctypes.data), 64, up)


def test_fake_copy_reads_pinned_source_when_it_runs(fake_device):
    """A DMA reads host memory when it runs: overwriting the staging buffer before the
    upload ran changes what arrives (why a staging set is reused only after its pass)."""
    cp, cupyx = fake_device.cupy, fake_device.cupyx
    s = cp.cuda.Stream(non_blocking=True)
    host = cupyx.empty_pinned((8,), dtype=np.uint8)
    host[:] = 1
    dev = cp.empty((8,), dtype=cp.uint8)
    dev.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), 8, s)
    host[:] = 2
    s.synchronize()
    assert dev.get().tolist() == [2] * 8


# --------------------------------------------------------------------------------------
# bit-identical to the CPU engine
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_pipelined_answers_match_the_cpu_engine(fake_device, depth):
    batches, slots = workload(depth, 12)
    wants = [CPU.probe(b, slots) for b in batches]
    eng = gpu()
    try:
        assert eng.pipelined and is_pipelined(eng)
        fake_device.SYNCS[0] = 0
        got = list(probe_many(eng, batches, slots, depth=depth))
        for g, w in zip(got, wants, strict=True):
            assert_same(g, w)
            assert {"upload_s", "kernels_s", "copyback_s", "wait_s", "total_s"} <= set(g.timings)
        # one host synchronisation per batch (the copy-back's last event), plus one per overflow
        assert fake_device.SYNCS[0] == len(batches) + eng.overflows
        assert eng.ring_waits == (0 if depth < 3 else eng.ring_waits)
    finally:
        eng.close()


@pytest.mark.parametrize("c,stride", [(1, 1), (8, 3), (16, 16), (16, 17)])
def test_pipelined_batch_sizes_and_strides(fake_device, c, stride):
    eng = gpu()
    try:
        for seed, (nq, ln) in enumerate([(1, 20), (3, 300), (8, 2000), (2, 9000)]):
            batches, slots = workload(100 + seed, 4, c=c, stride=stride, max_queries=nq, max_len=ln)
            for g, b in zip(probe_many(eng, batches, slots, depth=2), batches, strict=True):
                assert_same(g, CPU.probe(b, slots))
    finally:
        eng.close()


def test_pipelined_pass_splits_match(fake_device):
    batches, slots = workload(7, 6, max_len=5000)
    eng = gpu()
    try:
        eng.max_pass_tokens = 1500  # several passes per batch, through the middle of queries
        got = list(probe_many(eng, batches, slots, depth=2))
        for g, b in zip(got, batches, strict=True):
            assert_same(g, CPU.probe(b, slots))
        assert eng.split_batches >= 3 and eng.ring_waits > 0  # more passes in flight than staging sets
    finally:
        eng.close()


def test_overflowing_copy_back_is_still_exact(fake_device):
    batches, slots = workload(9, 6)
    eng = gpu(min_copy_rows=1)
    try:
        eng._rate = 0.0  # the guess copies one row back: every pass with more survivors overflows
        got = [h.result() for h in [eng.probe_async(b, slots) for b in batches]]
        for g, b in zip(got, batches, strict=True):
            assert_same(g, CPU.probe(b, slots))
        assert eng.overflows > 0
    finally:
        eng.close()


def test_slot_writes_between_submits_answer_as_at_submit(fake_device):
    """The mirror is brought up to date at submit: a batch in flight keeps the answer of the
    table it was submitted against while the next batch sees the writes."""
    batches, slots = workload(11, 8)
    rng = np.random.default_rng(4)
    eng = gpu()
    try:
        handles, wants = [], []
        for b in batches:
            wants.append(CPU.probe(b, slots))
            handles.append(eng.probe_async(b, slots))
            fps = _windows_fps(b.tokens, b.window)
            slots.insert(fps[rng.random(fps.size) < 0.2])  # more hits for the next batches
        for h, w in zip(handles, wants, strict=True):
            assert_same(h.result(), w)
    finally:
        eng.close()


def test_tokens_decoded_into_the_lent_pinned_buffer(fake_device):
    batches, slots = workload(13, 6)
    eng = gpu()
    try:
        for b in batches:
            lent = eng.lend_tokens(b.num_queries, b.num_tokens)
            assert lent is not None and lent.dtype == np.uint32 and lent.size == b.num_tokens
            lent[:] = b.tokens  # what decode_query_tokens does with its out buffer
            fake_device.DEVICE.h2d.clear()
            got = eng.probe_async(QueryBatch(lent, b.offsets, b.window, b.stride), slots).result()
            assert_same(got, CPU.probe(b, slots))
            # no host copy at submit: plan and tokens went in one copy of the whole staging area
            assert len(fake_device.DEVICE.h2d) == 1
            assert fake_device.DEVICE.h2d[0] == 8 * (2 * b.num_queries + 1) + 4 * b.num_tokens
        assert eng.lend_tokens(1, eng.max_pass_tokens + 1) is None  # would not fit one pass
    finally:
        eng.close()


def test_another_batch_between_loan_and_submit_leaves_the_loan_alone(fake_device):
    """A batch submitted by someone else after a loan and before the lent batch's own submit
    (another thread's probe, a re-probe) must not take the lent staging set."""
    batches, slots = workload(27, 2 * 3 + 2)
    eng = gpu()
    try:
        b = batches[0]
        lent = eng.lend_tokens(b.num_queries, b.num_tokens)
        lent[:] = b.tokens
        for other in batches[1:]:  # more batches than staging sets, each collected at once
            assert_same(eng.probe(other, slots), CPU.probe(other, slots))
        got = eng.probe_async(QueryBatch(lent, b.offsets, b.window, b.stride), slots).result()
        assert_same(got, CPU.probe(b, slots))
        assert eng.in_place_passes == 1
    finally:
        eng.close()


def test_a_stale_loan_is_copied_not_trusted(fake_device):
    """A batch whose tokens are not the current loan (an older one) is copied as usual."""
    batches, slots = workload(15, 2)
    eng = gpu()
    try:
        first = eng.lend_tokens(batches[0].num_queries, batches[0].num_tokens)
        first[:] = batches[0].tokens
        tokens = first.copy()
        eng.lend_tokens(batches[1].num_queries, batches[1].num_tokens)  # takes the loan back
        got = eng.probe(QueryBatch(tokens, batches[0].offsets, 16, 1), slots)
        assert_same(got, CPU.probe(batches[0], slots))
    finally:
        eng.close()


# --------------------------------------------------------------------------------------
# failover in the middle of a pipelined run
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["submit", "collect"])
@pytest.mark.parametrize("k", [0, 3, 7])
def test_failover_mid_pipeline_answers_everything(fake_device, where, k):
    batches, slots = workload(17, 8)
    wants = [CPU.probe(b, slots) for b in batches]
    inner = gpu()
    eng = gpu_select.FailoverEngine(inner)
    module = fake_device.RawModule.instances[-1]

    def gen():
        for i, b in enumerate(batches):
            if i == k and where == "submit":
                module.fail_next = True  # the flag kernel of batch k fails to launch
            yield b
            if i == k and where == "collect":
                for slot in inner._slots:  # batch k's wait for the device fails
                    def broken():
                        raise RuntimeError("cudaErrorIllegalAddress: simulated")
                    slot.ev["done"].synchronize = broken

    try:
        assert eng.pipelined
        got = list(probe_many(eng, gen(), slots, depth=3))
        for g, w in zip(got, wants, strict=True):
            assert_same(g, w)
        assert eng.failovers == 1 and eng.name == "cpu" and not eng.pipelined
    finally:
        eng.close()


def test_closed_engine_fails_batches_in_flight(fake_device):
    batches, slots = workload(19, 3)
    eng = gpu()
    handles = [eng.probe_async(b, slots) for b in batches]
    eng.close()
    for h in handles:
        with pytest.raises(EngineFailure):
            h.result()


# --------------------------------------------------------------------------------------
# mutation checks: each event wait the pipeline relies on, deleted, gives wrong answers
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", ["_stream", "_down"])
def test_a_missing_event_wait_is_caught(fake_device, stream):
    """``_stream``: the kernels no longer wait for the upload (they hash stale staging);
    ``_down``: the copy-back no longer waits for the kernels. Either must change answers."""
    batches, slots = workload(21, 6)
    wants = [CPU.probe(b, slots) for b in batches]
    eng = gpu()
    try:
        setattr(getattr(eng, stream), "wait_event", lambda event: None)
        try:
            got = list(probe_many(eng, batches, slots, depth=2))
        except EngineFailure:
            return
        assert any(not g.same_as(w) for g, w in zip(got, wants, strict=True))
    finally:
        eng.close()


# --------------------------------------------------------------------------------------
# every engine has the pipelined API (trivially on the host)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: ReferenceEngine(reason="t"), lambda: CpuEngine(reason="t"),
                                  lambda: XpEngine(np, reason="t"),
                                  lambda: gpu_select.FailoverEngine(CpuEngine(reason="t"))],
                         ids=["reference", "cpu", "xp-numpy", "failover-cpu"])
def test_host_engines_pipeline_trivially(make):
    batches, slots = workload(23, 5)
    eng = make()
    try:
        assert not is_pipelined(eng)
        assert isinstance(probe_async(eng, batches[0], slots), ReadyProbe) or not isinstance(eng, CpuEngine)
        for g, b in zip(probe_many(eng, batches, slots, depth=2), batches, strict=True):
            assert_same(g, CPU.probe(b, slots))
    finally:
        eng.close()


def test_probe_async_on_an_engine_without_it():
    class Plain:
        name, reason = "plain", "t"

        def probe(self, batch, slots):
            return CPU.probe(batch, slots)

    batches, slots = workload(25, 3)
    for g, b in zip(probe_many(Plain(), batches, slots), batches, strict=True):
        assert_same(g, CPU.probe(b, slots))
    with pytest.raises(ValueError):
        list(probe_many(Plain(), batches, slots, depth=0))


# --------------------------------------------------------------------------------------
# the same on a real device (``-m gpu``; skipped without one, failed with
# BLENDMATCH_REQUIRE_GPU=1): real streams, events and pinned memory
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_device_pipeline_matches_the_cpu_engine():
    from engines import gpu_engine_or_skip

    eng = gpu_engine_or_skip("fused")
    try:
        assert eng.pipelined
        batches, slots = workload(31, 12, max_len=20_000)
        wants = [CPU.probe(b, slots) for b in batches]
        for depth in (1, 2, 3, 5):
            for g, w in zip(probe_many(eng, batches, slots, depth=depth), wants, strict=True):
                assert_same(g, w)
        eng.max_pass_tokens = 7_000  # split passes, more in flight than staging sets
        for g, w in zip(probe_many(eng, batches, slots, depth=3), wants, strict=True):
            assert_same(g, w)
        eng.max_pass_tokens = 1 << 26
        eng.min_copy_rows, eng._rate = 1, 0.0  # every pass with survivors overflows its copy-back
        for g, w in zip(probe_many(eng, batches, slots, depth=2), wants, strict=True):
            assert_same(g, w)
        assert eng.overflows > 0
        for b, w in zip(batches, wants, strict=True):  # tokens written into the lent pinned area
            lent = eng.lend_tokens(b.num_queries, b.num_tokens)
            lent[:] = b.tokens
            assert_same(eng.probe_async(QueryBatch(lent, b.offsets, b.window, b.stride), slots).result(), w)
        assert eng.in_place_passes == len(batches)
    finally:
        eng.close()


@pytest.mark.gpu
def test_device_failover_mid_pipeline():
    from engines import gpu_engine_or_skip

    inner = gpu_engine_or_skip("fused")
    eng = gpu_select.FailoverEngine(inner)
    batches, slots = workload(33, 8)
    wants = [CPU.probe(b, slots) for b in batches]
    flag = inner._k_flag

    def gen():
        for i, b in enumerate(batches):
            if i == 4:
                def broken(*args, **kwargs):
                    raise RuntimeError("cudaErrorLaunchFailure: simulated")
                inner._k_flag = broken
            yield b

    try:
        for g, w in zip(probe_many(eng, gen(), slots, depth=3), wants, strict=True):
            assert_same(g, w)
        assert eng.failovers == 1 and eng.name == "cpu"
    finally:
        inner._k_flag = flag
        eng.close()
