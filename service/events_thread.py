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

Why (issue 28, item 1): with four posters of 64-entry bodies, each apply paid ~0.3 ms of
fixed cost on the events thread beside ~7 us per entry, and the event loop another future
hand-off per body; runs of the bodies that queue up behind a busy thread amortise both
(measured in ``docs/performance.md``, "Issue 28, second round"). A run is bounded
(``max_run`` tasks, ``max_run_bytes`` of bodies: 1 MiB, about one 1,000-entry body) because
the index's write lock is held for a whole run (a lookup's verification waits for it at
most one run).

Thread safety: ``submit`` may be called from any thread (the event loop in practice); the
queue is a ``deque`` under a lock; one kick per task is handed to a one-worker executor, and
a kick that finds its task already taken by a group does nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

__all__ = ["EventsThread", "GroupFn"]

T = TypeVar("T")

#: ``group_fn(list of argument tuples) -> list of results``, one per task, in order; an
#: ``Exception`` in the list is raised to that task's caller.
GroupFn = Callable[[list[tuple[Any, ...]]], Sequence[Any]]


@dataclass
class _Task:
    fn: Callable[..., Any] | None  # a plain call, or None for a grouped task
    group: GroupFn | None
    args: tuple[Any, ...]
    size: int
    future: Future = field(default_factory=Future)
    prepared: Optional[Future] = None  # the task's ``prepare`` result, computed on the prepare thread


class EventsThread:
    """One worker thread fed from one FIFO queue (see the module docstring)."""

    def __init__(self, *, max_run: int = 16, max_run_bytes: int = 1 << 20,
                 thread_name_prefix: str = "blendmatch-events") -> None:
        if max_run < 1 or max_run_bytes < 1:
            raise ValueError("max_run and max_run_bytes must be >= 1")
        self.max_run = max_run
        self.max_run_bytes = max_run_bytes
        self._executor: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=thread_name_prefix)
        self._prepare_prefix = f"{thread_name_prefix}-prepare"
        self._prepare: Optional[ThreadPoolExecutor] = None  # started by the first task with a prepare step
        self._queue: deque[_Task] = deque()
        self._lock = threading.Lock()
        #: Tasks submitted and not finished (the ``events_queue_depth`` gauge).
        self.pending = 0
        #: Grouped runs executed and the tasks they held (``runs_tasks / runs``: the mean run).
        self.runs = 0
        self.runs_tasks = 0

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Run ``fn(*args)`` on the thread after everything submitted before it."""
        return self._put(_Task(fn, None, args, 0))

    def submit_grouped(self, group: GroupFn, args: tuple[Any, ...], size: int,
                       prepare: Optional[Callable[..., Any]] = None) -> Future:
        """A task that may run in one call of ``group`` with the tasks of the same ``group``
        queued right behind it (``size``: its bytes, for the run's bound). ``prepare``: a
        step that depends on the task's ``args`` alone and holds the GIL little (an event
        body's nogil entries pass): it runs at once on the prepare thread, while the events
        thread applies what is ahead, and ``group`` gets its result as the last item of the
        task's ``args`` (None when it raised)."""
        task = _Task(None, group, args, max(0, int(size)))
        if prepare is not None:
            with self._lock:
                if self._executor is not None:
                    if self._prepare is None:
                        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._prepare_prefix)
                    task.prepared = self._prepare.submit(prepare, *args)
        return self._put(task)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` from the event loop, awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def run_grouped(self, group: GroupFn, args: tuple[Any, ...], size: int,
                          prepare: Optional[Callable[..., Any]] = None) -> Any:
        return await asyncio.wrap_future(self.submit_grouped(group, args, size, prepare))

    def _put(self, task: _Task) -> Future:
        with self._lock:
            executor = self._executor
            if executor is None:
                raise RuntimeError("the events thread is shut down")
            self._queue.append(task)
            self.pending += 1
            executor.submit(self._kick)
        return task.future

    # ------------------------------------------------------------------ the thread
    def _take(self) -> list[_Task]:
        """The next task, with the same-group tasks right behind it (within the bounds)."""
        with self._lock:
            if not self._queue:
                return []
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

    def _kick(self) -> None:
        taken = self._take()
        if not taken:
            return  # an earlier run took this kick's task
        try:
            first = taken[0]
            if first.fn is not None:
                _settle(first.future, first.fn, first.args)
                return
            live = [t for t in taken if t.future.set_running_or_notify_cancel()]  # a cancelled one is not applied
            if not live:
                return
            self.runs += 1
            self.runs_tasks += len(live)
            try:
                results = list(first.group([_args(t) for t in live]))  # type: ignore[misc]
                if len(results) != len(live):
                    raise RuntimeError(f"a grouped run returned {len(results)} results for {len(live)} tasks")
            except BaseException as exc:  # noqa: BLE001 - every task of the run learns it
                for t in live:
                    t.future.set_exception(exc)
                return
            for t, res in zip(live, results):
                if isinstance(res, BaseException):
                    t.future.set_exception(res)
                else:
                    t.future.set_result(res)
        finally:
            with self._lock:
                self.pending -= len(taken)

    # ------------------------------------------------------------------ stopping
    def shutdown(self, wait: bool = True) -> None:
        """No new tasks; with ``wait``, every task already submitted runs first."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait)
        with self._lock:  # after the events thread: its queued tasks wait for their prepare steps
            prepare, self._prepare = self._prepare, None
        if prepare is not None:
            prepare.shutdown(wait=wait)


def _args(task: _Task) -> tuple[Any, ...]:
    """A grouped task's arguments, with its prepare step's result last when it has one."""
    if task.prepared is None:
        return task.args
    try:
        return task.args + (task.prepared.result(),)
    except Exception:  # noqa: BLE001 - the group does the step itself
        return task.args + (None,)


def _settle(future: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        future.set_exception(exc)
    else:
        future.set_result(result)
