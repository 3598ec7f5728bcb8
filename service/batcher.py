"""The micro-batcher: many concurrent lookups in, one engine batch out, results fanned back.

Question answered: "how do N concurrent HTTP requests share one engine without the event
loop ever doing the engine's work?" Every lookup (single or batch endpoint) becomes one
:class:`_QueuedItem` with its own future. One worker task owns the queue:

1. it sleeps until the queue is non-empty;
2. with ``max_batch_wait_s > 0`` it waits until the budget is full or the *oldest* queued
   item has waited ``max_batch_wait_s`` (so the added latency is bounded by that value, and
   an item that already waited behind a busy engine is not delayed further);
3. it takes items from the front while their summed cost (tokens) fits ``max_batch_tokens``
   (always at least one: an item larger than the budget runs alone), skipping items whose
   future was cancelled (the caller went away; counted as dropped);
4. it runs ``run_batch(payloads)`` on its executor thread (one dedicated thread: the engine
   is used from one thread at a time and the event loop never hashes or probes);
5. it resolves each future with its own result. A result that is an exception instance
   fails only its own request (e.g. one query that does not decode). If ``run_batch``
   raises, every future of the batch gets that exception; if it returns a different number
   of results than it was given, every future gets :class:`BatchOutputMismatch`. No request
   is ever stranded.

Pipelined (a :class:`BatchPipeline` whose ``active()`` is true: the service on a GPU engine),
steps 4-5 run in two halves: the worker *starts* a batch (decode into pinned memory, submit
to the device) and holds it; on its next turn it takes whatever queued meanwhile and, in one
executor call, starts that batch before it *finishes* the held one (waits for the device,
verifies, encodes), then resolves the held batch's futures. So the device has batch N+1
before the host waits on batch N. On a CPU engine ``active()`` is false and nothing changes.

With ``max_batch_wait_s == 0`` (the default) step 2 is skipped: the batch is whatever queued
while the engine was busy. Under load that forms large batches; when idle it adds nothing.

Invariants: the queue and the futures are touched only from the event loop; ``run_batch``
runs only on the executor thread. ``stop()`` fails every queued or in-flight future with
:class:`ServiceUnavailable`. Metrics go to an optional observer (see :class:`BatchRecord`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from .errors import BatchOutputMismatch, ServiceUnavailable

__all__ = ["MicroBatcher", "BatchPipeline", "BatchRecord", "BatchObserver", "BatcherStats"]

log = logging.getLogger(__name__)

P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True)
class BatchRecord:
    """What one engine batch was: for metrics and tests."""

    queries: int
    tokens: int
    queue_waits: tuple[float, ...]  # seconds each request waited before its batch started
    run_s: float  # seconds run_batch took on the executor thread
    failed: bool
    dropped: int  # cancelled requests skipped when this batch was taken


class BatchObserver(Protocol):
    def __call__(self, record: BatchRecord) -> None: ...


@dataclass
class BatcherStats:
    """Running totals (cheap to read; for /directory/stats and the load test)."""

    batches: int = 0
    queries: int = 0
    tokens: int = 0
    failed_batches: int = 0
    dropped: int = 0
    busy_s: float = 0.0
    max_batch_queries: int = 0

    def as_dict(self) -> dict[str, float]:
        mean = self.queries / self.batches if self.batches else 0.0
        return {
            "batches": self.batches,
            "queries": self.queries,
            "tokens": self.tokens,
            "failed_batches": self.failed_batches,
            "dropped": self.dropped,
            "busy_seconds": round(self.busy_s, 6),
            "mean_batch_queries": round(mean, 3),
            "max_batch_queries": self.max_batch_queries,
        }


@dataclass(eq=False)
class _QueuedItem(Generic[P, R]):
    """One lookup waiting in the batcher's queue: its payload, token cost and future."""

    payload: P
    cost: int
    future: "asyncio.Future[R]"
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class BatchPipeline(Generic[P, R]):
    """``run_batch`` in two steps, for an engine that works while the host prepares the next
    batch (a GPU): ``start(payloads)`` submits a batch and returns at once, ``finish(started)``
    waits for it and returns the results (one per payload, as ``run_batch``). While
    ``active()`` says so, the batcher holds one started batch: it starts the next batch
    (whatever queued meanwhile) *before* finishing the held one, both in one executor call,
    so the device always has the next batch when it finishes one. When ``active()`` is
    false (a CPU engine: nothing to overlap) the batcher calls ``run_batch`` as usual."""

    active: Callable[[], bool]
    start: Callable[[list[P]], Any]
    finish: Callable[[Any], Sequence[R]]


@dataclass(eq=False)
class _Held(Generic[P, R]):
    """The pipelined batch started and not yet finished."""

    items: list["_QueuedItem[P, R]"]
    waits: tuple[float, ...]
    started: float
    handle: Any
    dropped: int


class MicroBatcher(Generic[P, R]):
    """Queue requests, run them in token-bounded batches on one executor thread.

    ``run_batch(payloads) -> results`` must return exactly one result per payload, in order
    (an exception instance as a result fails that payload alone); it runs on the executor
    thread, never on the event loop. ``cost(payload)`` is the
    payload's token count (what the budget bounds). ``thread_initializer`` runs once on the
    batcher's own thread when it starts (ignored when ``executor`` is given). Use as::

        batcher = MicroBatcher(run, cost=len, max_batch_tokens=1 << 18)
        await batcher.start()
        result = await batcher.submit(payload)
        await batcher.stop()
    """

    def __init__(
        self,
        run_batch: Callable[[list[P]], Sequence[R]],
        *,
        cost: Callable[[P], int],
        max_batch_tokens: int,
        max_batch_wait_s: float = 0.0,
        observer: BatchObserver | None = None,
        executor: ThreadPoolExecutor | None = None,
        thread_initializer: Callable[[], None] | None = None,
        name: str = "lookup",
        pipeline: "BatchPipeline[P, R] | None" = None,
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if max_batch_wait_s < 0:
            raise ValueError(f"max_batch_wait_s must be >= 0, got {max_batch_wait_s}")
        self._run_batch = run_batch
        self._cost = cost
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_wait_s = max_batch_wait_s
        self._observer = observer
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"blendmatch-{name}",
                                                        initializer=thread_initializer)
        self.name = name
        self._queue: deque[_QueuedItem[P, R]] = deque()
        self._queued_cost = 0
        self._inflight: list[_QueuedItem[P, R]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        self._pipeline = pipeline
        self._held: _Held[P, R] | None = None  # a pipelined batch started, not yet finished
        self.stats = BatcherStats()

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._worker is not None and not self._worker.done() and not self._closed

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The thread batches run on (for work that must run there too, e.g. a warm-up)."""
        return self._executor

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch (cancelled ones included until they are skipped)."""
        return len(self._queue)

    async def start(self) -> None:
        """Start the worker on the running loop. Idempotent while running."""
        if self._closed:
            raise ServiceUnavailable(f"{self.name} batcher was stopped; build a new one")
        if self._worker is None:
            self._wakeup = asyncio.Event()
            self._worker = asyncio.create_task(self._work(self._wakeup), name=f"blendmatch-{self.name}-batcher")
            self._worker.add_done_callback(self._worker_done)

    async def stop(self) -> None:
        """Stop taking requests; fail everything queued or in flight with ServiceUnavailable.

        Idempotent. The executor thread finishes the batch it is running (its results are
        discarded); an executor passed in by the caller is left to the caller.
        """
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        self._fail_all(ServiceUnavailable(f"{self.name} batcher is shutting down"))
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ submission
    async def submit(self, payload: P) -> R:
        """Queue one payload and wait for its result (or the batch's exception)."""
        return await self.submit_nowait(payload)  # cancelling the caller cancels the future: dropped

    def submit_nowait(self, payload: P) -> "asyncio.Future[R]":
        """:meth:`submit` without a coroutine: the payload's future (cancel it to drop the
        payload). Raises ``ServiceUnavailable`` when the batcher is not running."""
        if self._closed or self._worker is None or self._wakeup is None:
            raise ServiceUnavailable(f"{self.name} batcher is not running")
        cost = int(self._cost(payload))
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_QueuedItem(payload, cost, fut))
        self._queued_cost += cost
        self._wakeup.set()
        return fut

    async def submit_many(self, payloads: Sequence[P], *, return_exceptions: bool = False) -> list[Any]:
        """Queue several payloads back to back (so they tend to share a batch); results in order.

        If any fails, the first exception (in payload order) is raised after all have settled,
        or, with ``return_exceptions``, each failure is returned in its place. Cancelling the
        caller cancels (drops) every payload not yet taken.
        """
        if not payloads:
            return []
        futures = [self.submit_nowait(p) for p in payloads]
        try:
            settled = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        if not return_exceptions:
            for res in settled:
                if isinstance(res, BaseException):
                    raise res
        return list(settled)

    # ------------------------------------------------------------------ the worker
    def _worker_done(self, task: "asyncio.Task[None]") -> None:
        """A worker that died of a bug must not strand anyone: fail everything, refuse more."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s batcher worker died", self.name, exc_info=task.exception())
        self._closed = True
        self._fail_all(ServiceUnavailable(f"{self.name} batcher stopped after an internal error"))

    def _fail_all(self, exc: BaseException) -> None:
        """Deliver ``exc`` to every request in flight or queued, and forget them."""
        for item in [*self._inflight, *self._queue]:
            if not item.future.done():
                item.future.set_exception(exc)
        self._inflight = []
        self._held = None
        self._queue.clear()
        self._queued_cost = 0

    async def _work(self, wakeup: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        pipeline = self._pipeline
        while True:
            if pipeline is not None and (self._held is not None or (self._queue and pipeline.active())):
                await self._pipelined_step(loop, wakeup, pipeline)
                continue
            if not self._queue:
                wakeup.clear()
                await wakeup.wait()
                continue
            if self.max_batch_wait_s > 0:
                await self._wait_for_more(wakeup)
            batch, dropped = self._take()
            if not batch:
                self._note_dropped(dropped)
                continue
            self._inflight = batch
            started = time.perf_counter()
            waits = tuple(started - item.enqueued for item in batch)
            payloads = [item.payload for item in batch]
            error: BaseException | None = None
            results: Sequence[R] = ()
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, payloads)
            except asyncio.CancelledError:
                raise  # stop(): it fails the in-flight futures
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting future
                error = exc
            self._inflight = []
            self._settle(batch, waits, started, results, error, dropped)

    async def _pipelined_step(self, loop: asyncio.AbstractEventLoop, wakeup: asyncio.Event,
                              pipeline: "BatchPipeline[P, R]") -> None:
        """One turn of the pipelined loop (see :class:`BatchPipeline`): with no batch held,
        take one and start it; with one held, take the next (whatever queued meanwhile: the
        device is busy, so no ``max_batch_wait_s`` wait) and, in one executor call, start it
        and then finish the held one."""
        held = self._held
        if held is None:
            if not self._queue:
                wakeup.clear()
                await wakeup.wait()
                return
            if self.max_batch_wait_s > 0:
                await self._wait_for_more(wakeup)
            batch, dropped = self._take()
            if not batch:
                self._note_dropped(dropped)
                return
            self._inflight = batch
            started = time.perf_counter()
            waits = tuple(started - item.enqueued for item in batch)
            try:
                handle = await loop.run_in_executor(self._executor, pipeline.start, [i.payload for i in batch])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting future
                self._inflight = []
                self._settle(batch, waits, started, (), exc, dropped)
                return
            self._held = _Held(batch, waits, started, handle, dropped)
            return
        nxt, dropped = self._take() if self._queue else ([], 0)
        if not nxt:
            self._note_dropped(dropped)
        self._inflight = held.items + nxt
        started = time.perf_counter()
        payloads = [item.payload for item in nxt]

        def step() -> tuple[Any, BaseException | None, Sequence[R], BaseException | None]:
            handle = start_error = None
            if payloads:
                try:
                    handle = pipeline.start(payloads)  # batch N+1 is on its way before N is collected
                except Exception as exc:  # noqa: BLE001 - that batch's error
                    start_error = exc
            try:
                return handle, start_error, pipeline.finish(held.handle), None
            except Exception as exc:  # noqa: BLE001 - the held batch's error
                return handle, start_error, (), exc

        try:
            handle, start_error, results, error = await loop.run_in_executor(self._executor, step)
        except asyncio.CancelledError:
            raise
        self._held = None
        self._inflight = nxt
        self._settle(held.items, held.waits, held.started, results, error, held.dropped)
        if nxt:
            waits = tuple(started - item.enqueued for item in nxt)
            if start_error is not None:
                self._inflight = []
                self._settle(nxt, waits, started, (), start_error, dropped)
            else:
                self._held = _Held(nxt, waits, started, handle, dropped)

    def _note_dropped(self, dropped: int) -> None:
        if dropped:
            self.stats.dropped += dropped
            self._observe(BatchRecord(0, 0, (), 0.0, False, dropped))

    def _settle(self, batch: list[_QueuedItem[P, R]], waits: tuple[float, ...], started: float,
                results: Sequence[R], error: BaseException | None, dropped: int) -> None:
        """Resolve each future of ``batch`` with its result (or the batch's error), count it."""
        if error is None and len(results) != len(batch):
            error = BatchOutputMismatch(f"{self.name} batch returned {len(results)} results for {len(batch)} requests")
        if error is not None:
            log.error("%s batch of %d requests failed", self.name, len(batch), exc_info=error)
        run_s = time.perf_counter() - started
        if error is None:
            for item, res in zip(batch, results, strict=True):
                if item.future.done():
                    continue
                if isinstance(res, BaseException):
                    item.future.set_exception(res)
                else:
                    item.future.set_result(res)
        else:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
        tokens = sum(item.cost for item in batch)
        st = self.stats
        st.batches += 1
        st.queries += len(batch)
        st.tokens += tokens
        st.busy_s += run_s
        st.dropped += dropped
        st.failed_batches += error is not None
        st.max_batch_queries = max(st.max_batch_queries, len(batch))
        self._observe(BatchRecord(len(batch), tokens, waits, run_s, error is not None, dropped))

    async def _wait_for_more(self, wakeup: asyncio.Event) -> None:
        deadline = self._queue[0].enqueued + self.max_batch_wait_s
        while self._queued_cost < self.max_batch_tokens:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> tuple[list[_QueuedItem[P, R]], int]:
        """Pop the next batch: live items in arrival order within the token budget."""
        batch: list[_QueuedItem[P, R]] = []
        dropped = 0
        used = 0
        queue = self._queue
        while queue:
            item = queue[0]
            if item.future.done():  # cancelled by its caller (or failed by stop)
                queue.popleft()
                self._queued_cost -= item.cost
                dropped += 1
                continue
            if batch and used + item.cost > self.max_batch_tokens:
                break
            queue.popleft()
            self._queued_cost -= item.cost
            batch.append(item)
            used += item.cost
        return batch, dropped

    def _observe(self, record: BatchRecord) -> None:
        if self._observer is None:
            return
        try:
            self._observer(record)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("batch observer failed")
