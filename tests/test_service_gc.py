"""Garbage-collector hygiene of a long-running server: the directory's structures are acyclic
(so freezing them is safe) and the service freezes after each configured volume of events."""

from __future__ import annotations

import gc

import pytest

from blendmatch.index.key_directory import KeyDirectory
from service_support import chunks, config, events, served, store

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _store_then_delete(d: KeyDirectory, instance: str, first_hash: int) -> None:
    rows = chunks(400, seed=first_hash)
    for k in range(4):
        d.apply(events(store(instance, k + 1, rows[k * 100:(k + 1) * 100], first_hash=first_hash + k * 100)))
    for k in range(4):
        batch = store(instance, 10 + k, rows[k * 100:(k + 1) * 100], first_hash=first_hash + k * 100)
        batch["event_type"] = "delete"
        d.apply(events(batch))


_NO_CYCLES = """
import gc, sys
sys.path.insert(0, {tests!r})
from blendmatch.index.key_directory import KeyDirectory
from test_service_gc import _store_then_delete
d = KeyDirectory()
d.enable_blend_lookup(16, 1, engine="cpu")
_store_then_delete(d, "warm", 0)  # first use: compilation, interning, caches
gc.collect()
gc.disable()
_store_then_delete(d, "steady", 10_000)
assert d.stats()["keys"] == 0
print(gc.collect())
"""


def test_directory_store_and_delete_leave_no_cycles():
    """In a fresh interpreter: in this one, threads that earlier tests left winding down (a
    server's, a Kafka client's) make garbage of their own while the collector is off."""
    import subprocess
    import sys
    from pathlib import Path

    got = subprocess.run([sys.executable, "-c", _NO_CYCLES.format(tests=str(Path(__file__).parent))],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.strip() == "0", f"the directory left {got.stdout.strip()} cyclic objects: freezing it would leak"


async def test_service_freezes_after_the_configured_event_volume():
    gc.unfreeze()
    try:
        async with served(config(gc_freeze_ingest_bytes=1)) as (client, _app):
            before = gc.get_freeze_count()
            r = await client.post("/events", json=events(store("i", 1, chunks(3))))
            assert r.status_code == 200
            assert gc.get_freeze_count() > before
        gc.unfreeze()
        async with served(config()) as (client, _app):  # default: 64 MiB, far above this body
            r = await client.post("/events", json=events(store("i", 1, chunks(3))))
            assert r.status_code == 200 and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


_TRIM_RELEASES = """
import ctypes, sys
from blendmatch.service.heap import release_free_heap, trim_available
if not trim_available():
    print("no-glibc"); sys.exit(0)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD fixed at 1 MiB: the 64 KiB blocks below come from the heap
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
start = rss()
blocks = [libc.malloc(64 << 10) for _ in range(2049)]  # 128 MiB in the heap
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
blocks.sort()
pin = blocks.pop()  # the highest one stays: the heap's top cannot simply shrink below it
for b in blocks:
    libc.free(b)
before = rss()
released = release_free_heap()
print(released, (before - start) >> 20, (before - rss()) >> 20)
"""


def test_release_free_heap_returns_free_pages_in_the_middle_of_the_heap():
    """In a fresh interpreter with glibc: 128 MiB freed below a live block stay resident (the
    heap's top cannot shrink past it) until ``release_free_heap``, which gives them back."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", _TRIM_RELEASES], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    if got.stdout.strip() == "no-glibc":
        pytest.skip("the C library has no malloc_trim")
    released, kept, mib = got.stdout.split()
    assert int(kept) >= 100, f"the freed blocks should stay resident until the trim; {kept} MiB did"
    assert released == "True"
    assert int(mib) >= 100, f"only {mib} MiB of the 128 freed were released"


async def test_service_releases_free_heap_on_the_events_thread_with_each_freeze(monkeypatch):
    """Each freeze queues one ``release_free_heap`` on the events thread (never on the event
    loop's thread); ``--no-release-free-heap`` queues none."""
    import threading

    from blendmatch.service import heap

    calls: list[str] = []
    real = heap.release_free_heap

    def spy() -> bool:
        calls.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(heap, "release_free_heap", spy)
    gc.unfreeze()
    try:
        for on in (True, False):
            calls.clear()
            async with served(config(gc_freeze_ingest_bytes=1, release_free_heap=on)) as (client, app):
                for seq in (1, 2):
                    r = await client.post("/events", json=events(store("i", seq, chunks(3), first_hash=seq * 10)))
                    assert r.status_code == 200
                # the trim is queued behind the body's run: a third body's answer comes after it
                r = await client.post("/events", json=events(store("i", 3, chunks(3), first_hash=30)))
                assert r.status_code == 200
            if on:
                assert len(calls) >= 2 and all(name.startswith("blendmatch-events") for name in calls), calls
            else:
                assert calls == []
    finally:
        gc.unfreeze()
