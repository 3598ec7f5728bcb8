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
