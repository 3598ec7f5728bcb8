"""The events thread: the one thread that changes the directory, in arrival order, applying
event bodies that wait back to back as one run.

Question answered: "several ``POST /events`` bodies arrived while the events thread was busy:
must each pay a whole apply?" No. Every task (an event body, a registry change, the start-up
restore, a Kafka record check) joins one FIFO queue; the thread takes them in order, and a
task that may be *grouped* takes with it the tasks of the same kind queued right behind it
(never past a task of another kind, so the order of everything is arrival order, as with a
plain one-thread executor). For event bodies the group is applied as one
``KeyDirectory.apply_many`` run (``event_source.decode_and_apply_run``): one hold of the
locks, one deferral buffer, one ``add_many`` of the run's new chunks, each body still
answered with its own report or error, and the same resulting state as one by one.

Why: with four posters of 64-entry bodies, each apply paid ~0.3 ms of
fixed cost on the events thread beside ~7 us per entry, and the event loop another future
hand-off per body; runs of the bodies that queue up behind a busy thread amortise both
(``docs/performance.md``, "Where ingest's time goes"). A run is bounded
(``max_run`` tasks, ``max_run_bytes`` of bodies: 1 MiB, about one 1,000-entry body) because
the index's write lock is held for a whole run (a lookup's verification waits for it at
most one run).

Thread safety: ``submit`` may be called from any thread (the event loop in practice); the
queue is a ``deque`` under a condition the thread waits on. A task awaited from an event
loop (``run``, ``run_grouped``) is answered through an asyncio future of that loop: the
thread hands a run's answers to the loop in one ``call_soon_threadsafe`` (one wake-up of
the loop per run, not per body). Measured with 4 concurrent callers of a trivial group:
35 us of CPU per task with a concurrent future, a kick through a thread pool and
``wrap_future`` per task, 12.6 us this way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

__all__ = ["MAX_RUN_BYTES", "EventsThread", "GroupFn"]

T = TypeVar("T")

log = logging.getLogger(__name__)

#: ``group_fn(list of argument tuples) -> list of results``, one per task, in order; an
#: ``Exception`` in the list is raised to that task's caller.
GroupFn = Callable[[list[tuple[Any, ...]]], Sequence[Any]]

#: Bytes of bodies one run takes at most (about one 1,000-entry body; see the module docstring).
MAX_RUN_BYTES = 1 << 20


@dataclass
class _Task:
    fn: Callable[..., Any] | None  # a plain call, or None for a grouped task
    group: GroupFn | None
    args: tuple[Any, ...]
    size: int
    future: Optional[Future] = None  # the caller's future (a caller on a thread), or
    waiter: Optional[asyncio.Future] = None  # the awaiting coroutine's future (answered on its loop)
    prepared: Optional[Future] = None  # the task's ``prepare`` result, computed on the prepare thread

    def start(self) -> bool:
        """False when the caller gave up before the task ran (it is then not run)."""
        if self.waiter is not None:
            return not self.waiter.cancelled()  # a racy read: a cancel after it loses only the answer
        return self.future.set_running_or_notify_cancel()  # type: ignore[union-attr]


class EventsThread:
    """One worker thread fed from one FIFO queue (see the module docstring)."""

    def __init__(self, *, max_run: int = 16, max_run_bytes: int = MAX_RUN_BYTES,
                 thread_name_prefix: str = "blendmatch-events") -> None:
        if max_run < 1 or max_run_bytes < 1:
            raise ValueError("max_run and max_run_bytes must be >= 1")
        self.max_run = max_run
        self.max_run_bytes = max_run_bytes
        self._prepare_prefix = f"{thread_name_prefix}-prepare"
        self._prepare: Optional[ThreadPoolExecutor] = None  # started by the first task with a prepare step
        self._queue: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._open = True  # False once shut down: no new tasks
        self._thread = threading.Thread(target=self._run, name=f"{thread_name_prefix}_0", daemon=True)
        self._thread.start()
        #: Tasks submitted and not finished (the ``events_queue_depth`` gauge).
        self.pending = 0
        #: Grouped runs executed and the tasks they held (``runs_tasks / runs``: the mean run).
        self.runs = 0
        self.runs_tasks = 0

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Run ``fn(*args)`` on the thread after everything submitted before it."""
        task = _Task(fn, None, args, 0, future=Future())
        self._put(task)
        return task.future  # type: ignore[return-value]

    def submit_grouped(self, group: GroupFn, args: tuple[Any, ...], size: int,
                       prepare: Optional[Callable[..., Any]] = None) -> Future:
        """A task that may run in one call of ``group`` with the tasks of the same ``group``
        queued right behind it (``size``: its bytes, for the run's bound). ``prepare``: a
        step that depends on the task's ``args`` alone and holds the GIL little (an event
        body's nogil entries pass): it runs at once on the prepare thread, while the events
        thread applies what is ahead, and ``group`` gets its result as the last item of the
        task's ``args`` (None when it raised)."""
        task = _Task(None, group, args, max(0, int(size)), future=Future())
        self._put(task, prepare)
        return task.future  # type: ignore[return-value]

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` from the event loop, awaited."""
        return await self._awaited(_Task(fn, None, args, 0))

    async def run_grouped(self, group: GroupFn, args: tuple[Any, ...], size: int,
                          prepare: Optional[Callable[..., Any]] = None) -> Any:
        """``submit_grouped`` from the event loop, awaited."""
        return await self._awaited(_Task(None, group, args, max(0, int(size))), prepare)

    async def _awaited(self, task: _Task, prepare: Optional[Callable[..., Any]] = None) -> Any:
        task.waiter = asyncio.get_running_loop().create_future()
        self._put(task, prepare)
        return await task.waiter

    def _put(self, task: _Task, prepare: Optional[Callable[..., Any]] = None) -> None:
        with self._lock:
            if not self._open:
                raise RuntimeError("the events thread is shut down")
            if prepare is not None:
                if self._prepare is None:
                    self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._prepare_prefix)
                task.prepared = self._prepare.submit(prepare, *task.args)
            self._queue.append(task)
            self.pending += 1
            if len(self._queue) == 1:
                self._work.notify()  # the thread waits only on an empty queue

    # ------------------------------------------------------------------ the thread
    def _take(self) -> list[_Task]:
        """The next task, with the same-group tasks right behind it (within the bounds);
        waits for one; [] once shut down with nothing left."""
        with self._lock:
            while not self._queue:
                if not self._open:
                    return []
                self._work.wait()
            first = self._queue.popleft()
            taken = [first]
            if first.group is not None:
                size = first.size
                while (self._queue and len(taken) < self.max_run and self._queue[0].group == first.group
                       and size + self._queue[0].size <= self.max_run_bytes):
                    nxt = self._queue.popleft()
                    size += nxt.size
                    taken.append(nxt)
            return taken

    def _run(self) -> None:
        while True:
            taken = self._take()
            if not taken:
                return
            try:
                self._execute(taken)
            except BaseException:  # noqa: BLE001 - a bug here must not stop the thread (every later task would hang)
                log.exception("the events thread failed to answer a task; going on")
            finally:
                with self._lock:
                    self.pending -= len(taken)

    def _execute(self, taken: list[_Task]) -> None:
        first = taken[0]
        if first.fn is not None:
            if first.start():
                try:
                    result: Any = first.fn(*first.args)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    result = exc
                _answer([first], [result])
            return
        live = [t for t in taken if t.start()]  # a cancelled one is not applied
        if not live:
            return
        self.runs += 1
        self.runs_tasks += len(live)
        try:
            results = list(first.group([_args(t) for t in live]))  # type: ignore[misc]
            if len(results) != len(live):
                raise RuntimeError(f"a grouped run returned {len(results)} results for {len(live)} tasks")
        except BaseException as exc:  # noqa: BLE001 - every task of the run learns it
            results = [exc] * len(live)
        _answer(live, results)

    # ------------------------------------------------------------------ stopping
    def shutdown(self, wait: bool = True) -> None:
        """No new tasks; every task already submitted still runs (with ``wait``, before this
        returns)."""
        with self._lock:
            self._open = False
            self._work.notify()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:  # after the events thread: its queued tasks wait for their prepare steps
            prepare, self._prepare = self._prepare, None
        if prepare is not None:
            prepare.shutdown(wait=wait)  # steps already submitted still run


def _answer(tasks: list[_Task], results: list[Any]) -> None:
    """Each task's result (an exception is raised to its caller): futures at once, waiters
    of an event loop in one callback on that loop per run."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any]]] = {}
    for t, res in zip(tasks, results):
        if t.waiter is not None:
            batches.setdefault(t.waiter.get_loop(), []).append((t.waiter, res))
        elif isinstance(res, BaseException):
            t.future.set_exception(res)  # type: ignore[union-attr]
        else:
            t.future.set_result(res)  # type: ignore[union-attr]
    for loop, pairs in batches.items():
        try:
            loop.call_soon_threadsafe(_settle_waiters, pairs)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _settle_waiters(pairs: list[tuple[asyncio.Future, Any]]) -> None:
    """On the waiters' event loop: answer each one still waiting."""
    for waiter, res in pairs:
        if waiter.done():  # cancelled meanwhile
            continue
        if isinstance(res, BaseException):
            waiter.set_exception(res)
        else:
            waiter.set_result(res)


def _args(task: _Task) -> tuple[Any, ...]:
    """A grouped task's arguments, with its prepare step's result last when it has one."""
    if task.prepared is None:
        return task.args
    try:
        return task.args + (task.prepared.result(),)
    except Exception:  # noqa: BLE001 - the group does the step itself
        return task.args + (None,)
