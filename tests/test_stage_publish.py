"""New contents are staged before the index's write lock is taken and published under it
(issue 28 item 2): the hold a lookup's verification waits for is the publish (the
fingerprint map and the slot array), not the copy of the rows. Checked by recording, for
every staging while a directory ingests, whether the write lock was held; that nothing
staged is visible before its publish; that a fingerprint map or slot table the publish
grows is built before the hold; that token blocks are faulted in without ``MAP_POPULATE``
(which keeps the GIL); and that the answers, counts and sizes are those of an index that
stages and grows under the lock (the old way)."""

from __future__ import annotations

import threading

import numpy as np

from blendmatch.bench.events import make_requests
from blendmatch.index.blend_index import BlendIndex
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import BlendNamespace

C = 16
NS = BlendNamespace("meta-llama/Llama-3.1-8B", "", 1)


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=(n, C), dtype=np.uint32)


def _state(index: BlendIndex) -> dict:
    """Stats but the slot table's version: it counts slot writes for the engines' mirrors,
    and a table grown ahead is one write where growing under the lock is a refill and then
    the inserts after it."""
    stats = index.stats()
    stats.pop("table_version")
    return stats


def test_staged_contents_are_invisible_until_published(monkeypatch):
    index = BlendIndex(chunk_size=C, engine="cpu")
    old, new = _rows(1, 3), _rows(2, 40)
    index.add_many(old, [b"old-%d" % i for i in range(3)], [0, C, 2 * C], NS)
    query = np.concatenate([old[1], new[0], new[39]])
    seen: list = []
    real_hold = BlendIndex._hold

    def hold(self) -> None:  # the write session takes its hold between staging and publishing
        assert not self.write_lock._is_owned()  # staged without the lock lookups wait for
        # another thread's lookup runs now, between staging and publishing
        t = threading.Thread(target=lambda: seen.append(self.match(query, NS)))
        t.start()
        t.join()
        real_hold(self)
        assert self.write_lock._is_owned() and self.writer_lock._is_owned()

    monkeypatch.setattr(BlendIndex, "_hold", hold)
    hashes = [b"new-%d" % i for i in range(40)]
    with index.write_session():
        views = index.add_many(new, hashes, np.arange(40) * C, NS)
        assert index.write_lock._is_owned()  # kept to the session's end
    assert not index.write_lock._is_owned() and not index.writer_lock._is_owned()
    assert [m.chunk_hash for m in seen[0]] == [b"old-1"]
    assert [m.chunk_hash for m in index.match(query, NS)] == [b"old-1", b"new-0", b"new-39"]
    assert all(v is not None and np.array_equal(v, r) for v, r in zip(views, new))


def test_staging_gives_the_same_state_as_adding_under_the_lock():
    """Fresh rows, reused (freed) rows, duplicates of a part's own new contents and rows
    naming contents already indexed, with two namespaces: stats, memory and answers equal
    to an index whose every add runs under its lock (``add`` one row at a time)."""
    staged, locked = BlendIndex(chunk_size=C, engine="cpu"), BlendIndex(chunk_size=C, engine="cpu")
    other = BlendNamespace("other-model", "salt", 2)
    rows = _rows(3, 300)
    rows[250:] = rows[:50]  # duplicates of contents of the same call
    hashes = [b"h-%d" % i for i in range(300)]
    nss = [NS if i % 3 else other for i in range(300)]
    offsets = np.arange(300) * C
    for ix in (staged, locked):
        ix.add_many(rows[:100], hashes[:100], offsets[:100], nss[:100])
        for i in range(0, 60, 2):  # free contents, occupants and claims for reuse
            assert ix.remove_chunk(rows[i], hashes[i])
    with staged.write_session():  # one part, staged whole before the hold
        staged.add_many(rows[60:], hashes[60:], offsets[60:], nss[60:])
    for i in range(60, 300):
        locked.add(rows[i], hashes[i], int(offsets[i]), nss[i])
    assert _state(staged) == _state(locked)
    for ns in (NS, other):
        query = rows[::7].reshape(-1)
        assert staged.match(query, ns) == locked.match(query, ns) and staged.match(query, ns)


def test_directory_runs_stage_before_their_hold(monkeypatch):
    d = KeyDirectory()
    index = d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="cpu")
    held: list[bool] = []
    real = BlendIndex._stage_new

    def recording(self, *a, **k):
        held.append(self.write_lock._is_owned())
        return real(self, *a, **k)

    monkeypatch.setattr(BlendIndex, "_stage_new", recording)
    requests = make_requests(600, 64, C, seed=5)
    for req in requests:
        d.apply(req)
    assert len(held) == len(requests) and not any(held), held
    assert not index.write_lock._is_owned() and not index.writer_lock._is_owned()
    rows = [np.asarray(e["token_ids"], dtype=np.uint32) for req in requests for e in req["batches"][0]["entries"]]
    assert len(d.blend_match(np.concatenate(rows[:50]), NS)) == 50


def test_growth_is_built_before_the_hold(monkeypatch):
    """A publish that grows the fingerprint map or the slot table swaps in tables built
    while staging (a refill of every live fingerprint: 4-10 ms of the write lock at
    131-262k chunks): built without the write lock, and the same state as an index whose
    every add grows under its lock."""
    from blendmatch.index.slots import SlotArray
    from blendmatch.index.storage import FingerprintMap

    d = KeyDirectory()
    index = d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="cpu")
    built: list[tuple[str, bool]] = []
    for cls, name in ((SlotArray, "build"), (FingerprintMap, "_rehashed")):
        real = getattr(cls, name)

        def recording(self, *a, _real=real, _name=name, **k):
            built.append((_name, index.write_lock._is_owned()))
            return _real(self, *a, **k)

        monkeypatch.setattr(cls, name, recording)
    requests = make_requests(3000, 64, C, seed=7)
    for req in requests:
        d.apply(req)
    kinds = [name for name, _ in built]
    assert kinds.count("build") >= 5 and kinds.count("_rehashed") >= 2, built  # 1024 slots -> 65,536
    assert not any(locked for _, locked in built), built

    locked = BlendIndex(chunk_size=C, engine="cpu")
    rows = [np.asarray(e["token_ids"], dtype=np.uint32) for req in requests for e in req["batches"][0]["entries"]]
    entries = [e for req in requests for e in req["batches"][0]["entries"]]
    for r, e in zip(rows, entries):
        locked.add(r, bytes.fromhex(e["key"]["chunk_hash_hex"]), e["token_offset"], NS)
    assert _state(index) == _state(locked)
    assert index.memory_bytes() == locked.memory_bytes()
    query = np.concatenate(rows[::37])
    assert index.match(query, NS) == locked.match(query, NS) and len(index.match(query, NS)) == len(rows[::37])


def test_token_blocks_fault_in_without_map_populate(monkeypatch):
    """``mmap.mmap`` keeps the GIL through its system call, and ``MAP_POPULATE`` made that
    ~3 ms per 8 MiB block, every thread stopped: a block is mapped bare and every page
    faulted in by the ``nogil`` kernel."""
    import mmap

    import blendmatch.index.storage as storage

    flags: list[int] = []
    touched: list[tuple[int, int]] = []
    real_mmap, real_prefault = mmap.mmap, storage._prefault

    def mapping(*a, **k):
        flags.append(k.get("flags", 0))
        return real_mmap(*a, **k)

    def prefault(buf, step):
        touched.append((buf.shape[0], step))
        return real_prefault(buf, step)

    monkeypatch.setattr(storage.mmap, "mmap", mapping)
    monkeypatch.setattr(storage, "_prefault", prefault)
    block = storage._alloc_block(4096, 256)  # 4 MiB
    assert block.shape == (4096, 256) and block.dtype == np.uint32 and block.flags.writeable
    block[-1] = 7
    assert flags and not flags[0] & getattr(mmap, "MAP_POPULATE", 0)
    assert touched == [(4096 * 256 * 4, mmap.PAGESIZE)]


def test_a_growing_slot_table_is_built_into_memory_prepared_ahead(monkeypatch):
    """Bulk adds that bring the slot table near its growth have its successor faulted in on
    the tables thread (not on the thread that adds), and the growth adopts that memory; the
    answers are those of an index that never prepares ahead."""
    import blendmatch.index.slots as slots

    prepared: list[tuple[threading.Thread, tuple]] = []
    real = slots._faulted_in

    def recording(size):
        arrays = real(size)
        prepared.append((threading.current_thread(), arrays))
        return arrays

    monkeypatch.setattr(slots, "_faulted_in", recording)
    index = BlendIndex(chunk_size=C, engine="cpu")
    plain = BlendIndex(chunk_size=C, engine="cpu")
    plain._slots.prepare_growth = lambda extra=0: None  # never ahead
    rows = _rows(11, 70_000)  # past 65,536 fingerprints: a 2^20-slot table grows to 2^21
    hashes = [i.to_bytes(8, "little") for i in range(len(rows))]
    for lo in range(0, len(rows), 1000):
        for ix in (index, plain):
            ix.add_many(rows[lo:lo + 1000], hashes[lo:lo + 1000], 0, NS)
    assert index._slots.size == 1 << 21
    assert [a[0].shape[0] for _, a in prepared] == [1 << 20, 1 << 21]
    assert all(t is not threading.current_thread() and t.name.startswith("blendmatch-tables") for t, _ in prepared)
    assert np.shares_memory(index._slots.table, prepared[-1][1][0])
    assert np.array_equal(index._slots.table, plain._slots.table)
    assert _state(index) == _state(plain)
    query = np.concatenate(rows[::997])
    assert index.match(query, NS) == plain.match(query, NS) and len(index.match(query, NS)) == len(rows[::997])
