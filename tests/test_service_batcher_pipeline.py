"""The micro-batcher's pipelined mode (``BatchPipeline``): batch N+1 is started before batch N
is finished, in one executor call; errors stay with their batch; nothing is stranded; with
the pipeline inactive (a CPU engine) the batcher calls ``run_batch`` exactly as before."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from blendmatch.service.batcher import BatchPipeline, BatchRecord, MicroBatcher
from blendmatch.service.errors import BatchOutputMismatch, ServiceUnavailable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Device:
    """A pipelined engine stand-in: ``start`` returns at once, ``finish`` takes ``delay``
    (the device's time); logs every call in order, and which thread made it."""

    def __init__(self, delay: float = 0.01, active: bool = True) -> None:
        self.delay = delay
        self.active = active
        self.log: list[tuple[str, tuple[int, ...]]] = []
        self.threads: set[str] = set()
        self.fail_start: set[int] = set()  # payload values whose batch fails to start
        self.fail_finish: set[int] = set()
        self.short: set[int] = set()  # payload values whose batch returns one result too few

    def run(self, payloads: list[int]) -> list[int]:
        self.log.append(("run", tuple(payloads)))
        return [2 * p for p in payloads]

    def start(self, payloads: list[int]) -> tuple[int, ...]:
        self.threads.add(threading.current_thread().name)
        self.log.append(("start", tuple(payloads)))
        if self.fail_start & set(payloads):
            raise RuntimeError("start failed")
        return tuple(payloads)

    def finish(self, handle: tuple[int, ...]) -> list[int]:
        self.threads.add(threading.current_thread().name)
        self.log.append(("finish", handle))
        time.sleep(self.delay)
        if self.fail_finish & set(handle):
            raise RuntimeError("finish failed")
        out = [2 * p for p in handle]
        return out[:-1] if self.short & set(handle) else out


async def batcher(dev: Device, **kw) -> MicroBatcher:
    records: list[BatchRecord] = []
    b = MicroBatcher(dev.run, cost=lambda p: 1, max_batch_tokens=kw.pop("max_batch_tokens", 1 << 20),
                     observer=records.append, pipeline=BatchPipeline(lambda: dev.active, dev.start, dev.finish), **kw)
    b.records = records  # type: ignore[attr-defined]
    await b.start()
    return b


async def test_next_batch_starts_before_the_previous_finishes():
    dev = Device(delay=0.02)
    b = await batcher(dev, max_batch_tokens=4)
    try:
        futs = [b.submit_nowait(i) for i in range(20)]
        assert await asyncio.gather(*futs) == [2 * i for i in range(20)]
        starts = [h for kind, h in dev.log if kind == "start"]
        finishes = [h for kind, h in dev.log if kind == "finish"]
        assert sorted(x for h in starts for x in h) == list(range(20)) and starts == finishes
        assert not any(kind == "run" for kind, _ in dev.log)
        for k in range(1, len(starts)):  # batch k started before batch k-1 finished
            assert dev.log.index(("start", starts[k])) < dev.log.index(("finish", starts[k - 1]))
        assert len(dev.threads) == 1 and b.stats.batches == len(starts) and b.stats.queries == 20
        assert all(not r.failed for r in b.records)
    finally:
        await b.stop()


async def test_a_lone_batch_is_finished_without_waiting_for_another():
    dev = Device(delay=0.0)
    b = await batcher(dev)
    try:
        assert await asyncio.wait_for(b.submit(5), 5) == 10
        assert dev.log == [("start", (5,)), ("finish", (5,))]
    finally:
        await b.stop()


async def test_errors_stay_with_their_batch():
    dev = Device(delay=0.01)
    dev.fail_start, dev.fail_finish, dev.short = {3}, {6}, {9}
    b = await batcher(dev, max_batch_tokens=1)  # one payload per batch
    try:
        res = await asyncio.gather(*(b.submit_nowait(i) for i in range(12)), return_exceptions=True)
        for i, r in enumerate(res):
            if i in (3, 6):
                assert isinstance(r, RuntimeError)
            elif i == 9:
                assert isinstance(r, BatchOutputMismatch)
            else:
                assert r == 2 * i
        assert b.stats.failed_batches == 3 and b.running
    finally:
        await b.stop()


async def test_inactive_pipeline_calls_run_batch_as_before():
    dev = Device(active=False)
    b = await batcher(dev)
    try:
        assert await asyncio.gather(*(b.submit_nowait(i) for i in range(8))) == [2 * i for i in range(8)]
        assert {kind for kind, _ in dev.log} == {"run"}
    finally:
        await b.stop()


async def test_switching_off_mid_run_drains_the_held_batch():
    """A failover to the CPU engine turns the pipeline off with a batch held: it is finished,
    then batches run whole again."""
    dev = Device(delay=0.01)
    b = await batcher(dev, max_batch_tokens=2)
    try:
        first = [b.submit_nowait(i) for i in range(4)]
        await asyncio.sleep(0)
        dev.active = False
        assert await asyncio.gather(*first) == [0, 2, 4, 6]
        assert await b.submit(7) == 14
        assert dev.log[-1] == ("run", (7,))
    finally:
        await b.stop()


async def test_stop_fails_the_held_batch():
    dev = Device(delay=0.3)
    b = await batcher(dev, max_batch_tokens=1)
    futs = [b.submit_nowait(i) for i in range(3)]
    await asyncio.sleep(0.05)
    await b.stop()
    for f in futs:
        with pytest.raises(ServiceUnavailable):
            await f
