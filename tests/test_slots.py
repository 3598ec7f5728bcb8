"""The slot array: tag/shared semantics, recall, change log, rebuilds."""

from __future__ import annotations

import numpy as np
import pytest

from blendmatch.gpu.fingerprint import TAG_SHARED, slots_and_tags
from blendmatch.index.slots import SlotArray


def _same_slot_pair(mask: int, rng) -> tuple[int, int]:
    """Two fingerprints that land in the same slot (found by search, not by construction)."""
    fps = rng.integers(0, 1 << 63, size=20_000, dtype=np.uint64)
    slots, _ = slots_and_tags(fps, mask)
    order = np.argsort(slots, kind="stable")
    dup = np.flatnonzero(np.diff(slots[order]) == 0)[0]
    return int(fps[order[dup]]), int(fps[order[dup + 1]])


def survives(s: SlotArray, fp: int) -> bool:
    slot, tag = slots_and_tags(np.array([fp], dtype=np.uint64), s.mask)
    v = s.table[slot[0]]
    return bool(v == tag[0] or v == TAG_SHARED)


def test_tag_written_then_cleared(rng):
    s = SlotArray()
    fp = 123456789
    s.insert(np.array([fp], dtype=np.uint64))
    slot, tag = slots_and_tags(np.array([fp], dtype=np.uint64), s.mask)
    assert s.table[slot[0]] == tag[0] and survives(s, fp)
    s.remove(np.array([fp], dtype=np.uint64))
    assert s.table[slot[0]] == 0 and not survives(s, fp)


def test_second_arrival_shares_and_removal_keeps_shared(rng):
    s = SlotArray()
    a, b = _same_slot_pair(s.mask, rng)
    s.insert(np.array([a], dtype=np.uint64))
    s.insert(np.array([b], dtype=np.uint64))
    slot = slots_and_tags(np.array([a], dtype=np.uint64), s.mask)[0][0]
    assert s.table[slot] == TAG_SHARED
    s.remove(np.array([a], dtype=np.uint64))
    assert survives(s, b), "a shared slot must never hide the remaining fingerprint"
    assert s.table[slot] == TAG_SHARED and s.stale == 1


def test_occupancy_mode_writes_255_and_never_clears():
    s = SlotArray("occupancy")
    fp = np.array([42], dtype=np.uint64)
    s.insert(fp)
    slot = slots_and_tags(fp, s.mask)[0][0]
    assert s.table[slot] == TAG_SHARED
    s.remove(fp)
    assert s.table[slot] == TAG_SHARED


def test_recall_is_complete_for_random_sets(rng):
    for mode in ("tagged", "occupancy"):
        s = SlotArray(mode)
        fps = rng.integers(0, 1 << 63, size=5000, dtype=np.uint64)
        s.rebuild(fps[:3000])
        s.insert(fps[3000:])
        s.remove(fps[:1000])
        assert all(survives(s, int(f)) for f in fps[1000:])


def test_change_log_replays_to_the_table(rng):
    s = SlotArray()
    mirror = s.table.copy()
    gen, ver = s.generation, s.version
    fps = rng.integers(0, 1 << 63, size=40, dtype=np.uint64)
    s.insert(fps[:30])
    s.remove(fps[:10])
    s.insert(fps[30:])
    ch = s.changes_since(gen, ver)
    assert not ch.full and ch.version == s.version
    mirror[ch.slots] = 0  # replay in order (numpy fancy assignment: last write wins on CPU)
    for sl, v in zip(ch.slots, ch.values):
        mirror[sl] = v
    assert np.array_equal(mirror, s.table)
    assert s.changes_since(ch.generation, ch.version).slots.size == 0


def test_rebuild_bumps_generation_and_forces_full_upload(rng):
    s = SlotArray()
    gen, ver = s.generation, s.version
    s.rebuild(rng.integers(0, 1 << 63, size=100, dtype=np.uint64))
    ch = s.changes_since(gen, ver)
    assert ch.full and ch.generation == gen + 1 and ch.table is s.table


def test_growth_keeps_load_at_most_one_sixteenth(rng):
    s = SlotArray()
    fps = rng.integers(0, 1 << 63, size=10_000, dtype=np.uint64)
    s.insert(fps[:64])
    assert not s.needs_rebuild()
    s.insert(fps[64:])
    assert s.needs_rebuild()
    s.rebuild(fps)
    assert s.size >= 16 * 10_000 and s.size & (s.size - 1) == 0 and not s.needs_rebuild()


def test_long_log_is_trimmed_to_full_upload(rng):
    s = SlotArray()
    s.rebuild(np.zeros(0, dtype=np.uint64), size=1 << 16)
    gen, ver = s.generation, s.version
    s.insert(rng.integers(0, 1 << 63, size=20_000, dtype=np.uint64))  # > size/4 changes
    assert s.changes_since(gen, ver).full


@pytest.mark.parametrize("bad", ["bloom", ""])
def test_bad_filter_name(bad):
    with pytest.raises(ValueError, match="filter"):
        SlotArray(bad)


def test_large_tables_are_zeroed_writable_and_aligned(rng):
    from blendmatch.index.slots import _alloc_table

    t = _alloc_table(4 << 20)
    assert t.dtype == np.uint8 and t.size == 4 << 20 and t.flags.writeable and t.flags.c_contiguous
    assert not t.any()
    t[-1] = 7  # the whole span is usable
    s = SlotArray()
    fps = rng.integers(0, 1 << 63, size=300_000, dtype=np.uint64)
    s.rebuild(fps)
    assert s.size >= 4 << 20 and all(survives(s, int(f)) for f in fps[:1000])


@pytest.mark.parametrize("mode", ["tagged", "occupancy"])
def test_occupancy_bits_follow_every_write(mode, rng):
    """The bits in front of the table (``gpu/occupancy.py``) say "not empty" exactly where
    the table does, after inserts, removals (including ones that clear a slot) and rebuilds;
    ``filter_arrays`` pairs the current table with its own bits."""
    from blendmatch.gpu.occupancy import occupancy_words

    s = SlotArray(mode)
    live: list[int] = []

    def check() -> None:
        table, words = s.filter_arrays
        assert table is s.table
        assert words.dtype == np.uint64 and words.size == (table.size + 63) // 64
        np.testing.assert_array_equal(words, occupancy_words(table))

    for step in range(60):
        new = rng.integers(0, 1 << 63, size=int(rng.integers(1, 200)), dtype=np.uint64)
        new = np.setdiff1d(new, np.array(live, dtype=np.uint64))
        s.insert(new)
        live.extend(int(f) for f in new)
        gone = [live.pop(int(rng.integers(0, len(live)))) for _ in range(min(len(live), int(rng.integers(0, 150))))]
        s.remove(np.array(gone, dtype=np.uint64))
        check()
        if step % 10 == 9 or s.needs_rebuild():
            s.rebuild(np.array(live, dtype=np.uint64))
            check()
    assert s.generation > 1 and np.count_nonzero(s.table) > 0
    if mode == "tagged":  # removals did clear slots, so clear_bit ran
        assert s.stats()["table_stale_removals"] < len(live) * 10


def test_memory_counts_the_occupancy_bits():
    s = SlotArray(min_size=1 << 16)
    assert s.nbytes == (1 << 16) + (1 << 16) // 8


def test_the_next_growths_table_is_prepared_ahead_and_used(rng):
    """Near its growth point a table's successor is mapped and faulted in on the tables
    thread; the growth's build writes into it and the result is the build a fresh table
    gets, byte for byte. Far from the point nothing is prepared (no memory held ahead)."""
    from blendmatch.index import slots as slots_mod

    s = SlotArray(min_size=1 << 20)  # grows at 65,536 fingerprints, to 2^21 slots
    at_growth = s.size // slots_mod.LOAD_RATIO
    zone = at_growth - at_growth // slots_mod.AHEAD_SHARE
    fps = rng.integers(0, 1 << 63, size=at_growth + 64, dtype=np.uint64)
    s.insert(fps[: zone - 100])
    s.prepare_growth(50)
    assert s._ahead is None  # outside the last 1/AHEAD_SHARE
    s.insert(fps[zone - 100: at_growth - 10])
    s.prepare_growth(5)
    size, future = s._ahead
    assert size == 2 * s.size
    prepared = future.result()
    s.prepare_growth(5)  # asked again: the same one, not a second
    assert s._ahead[1] is future
    assert s.needs_rebuild(64)
    built = s.build(fps)
    assert s._ahead is None
    assert np.shares_memory(built.table, prepared[0]) and np.shares_memory(built.words, prepared[1])
    fresh = SlotArray(min_size=1 << 20).build(fps)
    assert np.array_equal(built.table, fresh.table) and np.array_equal(built.words, fresh.words)
    assert (built.live, built.shared) == (fresh.live, fresh.shared)


def test_a_prepared_table_of_another_size_is_dropped(rng):
    """A build of another size (an explicit size, a shrink) does not take the prepared table,
    and drops it; falling back out of the zone drops it too."""
    from blendmatch.index import slots as slots_mod

    s = SlotArray(min_size=1 << 20)
    at_growth = s.size // slots_mod.LOAD_RATIO
    fps = rng.integers(0, 1 << 63, size=at_growth, dtype=np.uint64)
    s.insert(fps[:-8])
    s.prepare_growth(4)
    prepared = s._ahead[1].result()
    built = s.build(fps[:-8], size=4 * s.size)
    assert s._ahead is None and not np.shares_memory(built.table, prepared[0])
    assert np.array_equal(built.table, SlotArray(min_size=1 << 20).build(fps[:-8], size=4 * s.size).table)
    s.prepare_growth(4)
    assert s._ahead is not None
    s.remove(fps[: at_growth // 2])
    s.prepare_growth(0)
    assert s._ahead is None


def test_small_tables_are_not_prepared_ahead(rng):
    s = SlotArray()  # 1,024 slots: its successor is cheap to fault in where it is built
    s.insert(rng.integers(0, 1 << 63, size=s.size // 16 - 1, dtype=np.uint64))
    s.prepare_growth(1)
    assert s._ahead is None
