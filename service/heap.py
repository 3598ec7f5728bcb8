"""Handing the C allocator's free pages back to the operating system (glibc ``malloc_trim``).

Question answered: "the index grew to 1M chunks and then stopped growing: why does the
process keep megabytes it no longer uses, and who gives them back?" glibc's allocator
serves requests over its mmap threshold with their own mappings and the rest from its
heaps, and the threshold is dynamic: freeing a large mapped block raises it to that size.
Once the index has replaced a grown table (tens of MB at 1M chunks), the large temporaries
of ingest (a 1,000-entry body's token buffer, a growth's gathered fingerprints, a list's
reallocation) come from the heap, and the pages they leave free in the middle of it stay
resident: 47-67 B per chunk of a server filled with 1M chunks over HTTP, 45-64 MiB
(``bench/service_memory.py``; ``docs/performance.md``, "Memory per chunk"), a
figure that moves with the order of frees, not with what is stored.

``malloc_trim(0)`` releases every free page of every arena (``madvise``), not only the top
of the heap; it takes each arena's lock for the walk (36 calls while 1.3M chunks were
stored in process, 1,000-entry bodies: 0.6-2.2 ms, twice 3.8 and once 6.8 with another
process busy) and holds no Python lock: ctypes releases the GIL around the call. The service
calls it on the events thread, between runs, after every ``--gc-freeze-ingest-bytes`` of
event bodies (:class:`AfterIngest`, run by ``ServiceContext``): never on the event loop, never under the
directory's or the index's locks. Fixing the threshold instead (``mallopt(M_MMAP_THRESHOLD)``
at 128 KiB) was measured and dropped: every body's and every lookup batch's large buffer
then costs a fresh mapping and its page faults (ingest through HTTP 16-29% slower in two
alternating runs). Trimming only after the index replaced a grown table was dropped too:
at 1M chunks it kept 1,489 of the 1,491 B per chunk (in process), the pages being freed
between growths.
"""

from __future__ import annotations

import ctypes
import gc
from functools import cache
from typing import Callable, Optional

__all__ = ["AfterIngest", "release_free_heap", "trim_available"]


@cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        fn = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library
    except OSError:  # pragma: no cover - no dynamic C library to ask
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = ctypes.c_int
    return fn


def trim_available() -> bool:
    """Whether this process's C library has ``malloc_trim`` (glibc; not musl or macOS)."""
    return _malloc_trim() is not None


def release_free_heap() -> bool:
    """Return the allocator's free pages to the OS; True when some were released, False
    when none were or the C library has no ``malloc_trim`` (then nothing is done)."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


class AfterIngest:
    """The one rule of what a process does after each ``limit`` bytes of event bodies
    (``--gc-freeze-ingest-bytes``; 0: nothing): ``gc.freeze()``, then with ``release``
    (``--release-free-heap``) :func:`release_free_heap`, handed to ``run`` (the service:
    its events thread; default: called at once). The service and ``bench/floor_stages.py``
    both count through it.

    Why the freeze: the directory keeps a few Python objects per stored chunk, and CPython's
    full collection walks every tracked object: measured here, 264k objects (100k stored
    chunks) cost a 160 ms full pass, stalling every thread. Freezing moves the live objects
    out of the collector's sight (O(1)); they are still freed by reference counting when the
    directory drops them. Safe because the directory's structures are acyclic (a
    store-then-delete cycle of 5,000 entries left 0 unreachable objects,
    ``tests/test_service_gc.py``); objects that another thread happens to hold at the
    instant of a freeze and that later die in a cycle are not reclaimed, a bounded cost.
    Why the release: the module docstring. Not thread-safe: one caller at a time (the
    service's event loop, or its Kafka apply thread).
    """

    def __init__(self, limit: int, release: bool,
                 run: Optional[Callable[[Callable[[], bool]], None]] = None) -> None:
        self.limit = limit
        self.release = release
        self.run = run if run is not None else _call_now
        self._since = 0

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` of event bodies; at the limit, freeze and release."""
        if not self.limit:
            return
        self._since += nbytes
        if self._since >= self.limit:
            self._since = 0
            gc.freeze()
            if self.release:
                self.run(_release)


def _call_now(fn: Callable[[], bool]) -> None:
    fn()


def _release() -> bool:
    # looked up at each call, so that a test may watch the module's function
    return release_free_heap()
