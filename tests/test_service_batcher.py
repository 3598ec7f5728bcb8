"""The micro-batcher on its own: batching, budgets, failures, cancellation, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from blendmatch.service.batcher import BatchRecord, MicroBatcher
from blendmatch.service.errors import BatchOutputMismatch, ServiceUnavailable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class SlowEngine:
    """run_batch stand-in: doubles each payload, sleeping ``delay`` per batch; records batches."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()
        self.gate: threading.Event | None = None

    def __call__(self, payloads: list[int]) -> list[int]:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(5)
        self.batches.append(list(payloads))
        if self.delay:
            time.sleep(self.delay)
        return [2 * p for p in payloads]


async def started(engine, **kw) -> MicroBatcher:
    records: list[BatchRecord] = []
    kw.setdefault("max_batch_tokens", 1 << 20)
    b = MicroBatcher(engine, cost=kw.pop("cost", lambda p: 1), observer=records.append, **kw)
    b.records = records  # type: ignore[attr-defined]
    await b.start()
    return b


async def test_concurrent_submissions_form_batches_and_fan_out():
    eng = SlowEngine(delay=0.02)
    b = await started(eng)
    try:
        results = await asyncio.gather(*(b.submit(i) for i in range(64)))
        assert results == [2 * i for i in range(64)]
        sizes = [len(x) for x in eng.batches]
        assert sum(sizes) == 64
        assert sum(sizes) / len(sizes) > 1, sizes
        assert max(sizes) > 8
        assert b.stats.queries == 64 and b.stats.batches == len(sizes)
        assert threading.current_thread().name not in eng.threads
        assert len(eng.threads) == 1 and next(iter(eng.threads)).startswith("blendmatch-")
    finally:
        await b.stop()


async def test_token_budget_bounds_batches_and_big_items_run_alone():
    eng = SlowEngine(delay=0.01)
    eng.gate = threading.Event()
    b = await started(eng, cost=lambda p: 100 if p >= 1000 else 10, max_batch_tokens=35)
    try:
        tasks = [asyncio.create_task(b.submit(i)) for i in range(10)]
        tasks.append(asyncio.create_task(b.submit(1000)))
        tasks += [asyncio.create_task(b.submit(i)) for i in range(10, 14)]
        await asyncio.sleep(0.05)
        eng.gate.set()
        res = await asyncio.gather(*tasks)
        assert res[10] == 2000
        for batch in eng.batches:
            cost = sum(100 if p >= 1000 else 10 for p in batch)
            assert cost <= 35 or batch == [1000], eng.batches
        assert [1000] in eng.batches
        assert all(r.tokens <= 35 or r.queries == 1 for r in b.records)
        # arrival order is preserved across batches
        flat = [p for batch in eng.batches for p in batch]
        assert flat == list(range(10)) + [1000] + list(range(10, 14))
    finally:
        await b.stop()


async def test_failure_reaches_every_waiting_future_and_serving_continues():
    calls = {"n": 0}
    gate = threading.Event()

    def boom(payloads):
        calls["n"] += 1
        if calls["n"] == 1:
            gate.wait(5)  # let the others queue behind the first batch
            return [0 for _ in payloads]
        if calls["n"] == 2:
            raise RuntimeError("engine on fire")
        return [p for p in payloads]

    b = await started(boom)
    try:
        first = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.02)
        waiting = [asyncio.create_task(b.submit(i)) for i in range(1, 9)]
        await asyncio.sleep(0.02)
        gate.set()
        assert await first == 0
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(o, RuntimeError) and "on fire" in str(o) for o in outcomes), outcomes
        assert b.stats.failed_batches == 1
        assert await b.submit(42) == 42  # still serving
    finally:
        await b.stop()


async def test_output_count_mismatch_fails_the_whole_batch():
    b = await started(lambda payloads: payloads[:-1])
    try:
        outcomes = await asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(o, BatchOutputMismatch) for o in outcomes), outcomes
    finally:
        await b.stop()


async def test_cancelled_request_is_dropped_not_run():
    eng = SlowEngine()
    eng.gate = threading.Event()
    b = await started(eng)
    try:
        blocker = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.02)  # batch [0] is now running (blocked on the gate)
        keep = asyncio.create_task(b.submit(1))
        victim = asyncio.create_task(b.submit(2))
        keep2 = asyncio.create_task(b.submit(3))
        await asyncio.sleep(0.01)
        victim.cancel()
        await asyncio.sleep(0.01)
        eng.gate.set()
        assert await blocker == 0 and await keep == 2 and await keep2 == 6
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert all(2 not in batch for batch in eng.batches), eng.batches
        assert b.stats.dropped == 1
        assert sum(r.dropped for r in b.records) == 1
    finally:
        await b.stop()


async def test_submit_many_keeps_order_and_shares_a_batch():
    eng = SlowEngine()
    b = await started(eng)
    try:
        assert await b.submit_many([5, 6, 7]) == [10, 12, 14]
        assert eng.batches == [[5, 6, 7]]
        assert await b.submit_many([]) == []
    finally:
        await b.stop()


async def test_max_batch_wait_collects_late_arrivals():
    eng = SlowEngine()
    b = await started(eng, max_batch_wait_s=0.2, cost=lambda p: 1, max_batch_tokens=4)
    try:
        async def late(i):
            await asyncio.sleep(0.01 * i)
            return await b.submit(i)

        t0 = time.perf_counter()
        assert await asyncio.gather(*(late(i) for i in range(4))) == [0, 2, 4, 6]
        # the budget (4) filled before the 200 ms deadline: one batch, no full wait
        assert eng.batches == [[0, 1, 2, 3]]
        assert time.perf_counter() - t0 < 0.19
        # a lone request waits at most ~max_batch_wait_s
        t0 = time.perf_counter()
        assert await b.submit(9) == 18
        assert 0.15 < time.perf_counter() - t0 < 1.0
    finally:
        await b.stop()


async def test_stop_fails_queued_and_inflight_requests_and_refuses_new_ones():
    eng = SlowEngine()
    eng.gate = threading.Event()
    b = await started(eng)
    inflight = asyncio.create_task(b.submit(1))
    await asyncio.sleep(0.02)
    queued = asyncio.create_task(b.submit(2))
    await asyncio.sleep(0.01)
    await b.stop()
    eng.gate.set()
    for t in (inflight, queued):
        with pytest.raises(ServiceUnavailable):
            await t
    with pytest.raises(ServiceUnavailable):
        await b.submit(3)
    await b.stop()  # idempotent


async def test_submit_before_start_is_refused():
    b = MicroBatcher(SlowEngine(), cost=lambda p: 1, max_batch_tokens=10)
    with pytest.raises(ServiceUnavailable):
        await b.submit(1)
    await b.stop()


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        MicroBatcher(SlowEngine(), cost=len, max_batch_tokens=0)
    with pytest.raises(ValueError, match="max_batch_wait_s"):
        MicroBatcher(SlowEngine(), cost=len, max_batch_tokens=1, max_batch_wait_s=-1)
