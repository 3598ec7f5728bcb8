"""Handing the C allocator's free pages back to the operating system (glibc ``malloc_trim``).

Question answered: "the index grew to 1M chunks and then stopped growing: why does the
process keep megabytes it no longer uses, and who gives them back?" glibc's allocator
serves requests over its mmap threshold with their own mappings and the rest from its
heaps, and the threshold is dynamic: freeing a large mapped block raises it to that size.
Once the index has replaced a grown table (tens of MB at 1M chunks), the large temporaries
of ingest (a 1,000-entry body's token buffer, a growth's gathered fingerprints, a list's
reallocation) come from the heap, and the pages they leave free in the middle of it stay
resident: 47-67 B per chunk of a server filled with 1M chunks over HTTP, 45-64 MiB
(``bench/service_memory.py``; ``docs/performance.md``, "Issue 28, seventh round"), a
figure that moves with the order of frees, not with what is stored.

``malloc_trim(0)`` releases every free page of every arena (``madvise``), not only the top
of the heap; it takes each arena's lock for the walk (36 calls while 1.3M chunks were
stored in process, 1,000-entry bodies: 0.6-2.2 ms, twice 3.8 and once 6.8 with another
process busy) and holds no Python lock: ctypes releases the GIL around the call. The service
calls it on the events thread, between runs, after every ``--gc-freeze-ingest-bytes`` of
event bodies (``ServiceContext.note_ingested``): never on the event loop, never under the
directory's or the index's locks. Fixing the threshold instead (``mallopt(M_MMAP_THRESHOLD)``
at 128 KiB) was measured and dropped: every body's and every lookup batch's large buffer
then costs a fresh mapping and its page faults (ingest through HTTP 16-29% slower in two
alternating runs). Trimming only after the index replaced a grown table was dropped too:
at 1M chunks it kept 1,489 of the 1,491 B per chunk (in process), the pages being freed
between growths.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Optional

__all__ = ["release_free_heap", "trim_available"]

_trim: Optional[Callable[[int], int]] = None
_looked_up = False


def _malloc_trim() -> Optional[Callable[[int], int]]:
    global _trim, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            fn = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library
        except OSError:  # pragma: no cover - no dynamic C library to ask
            fn = None
        if fn is not None:
            fn.argtypes = [ctypes.c_size_t]
            fn.restype = ctypes.c_int
        _trim = fn
    return _trim


def trim_available() -> bool:
    """Whether this process's C library has ``malloc_trim`` (glibc; not musl or macOS)."""
    return _malloc_trim() is not None


def release_free_heap() -> bool:
    """Return the allocator's free pages to the OS; True when some were released, False
    when none were or the C library has no ``malloc_trim`` (then nothing is done)."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
