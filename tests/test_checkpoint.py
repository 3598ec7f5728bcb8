"""Checkpoints in-process: the file format (checksums, versions, truncation, atomic write
against a writer killed half-way), and restore answering exactly as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from blendmatch.index.checkpoint import IncompatibleCheckpoint, capture, inspect_checkpoint, restore_directory
from blendmatch.index.ckpt_file import (
    CheckpointError,
    CorruptCheckpoint,
    Section,
    UnknownCheckpointVersion,
    read_checkpoint,
    remove_stale_temporaries,
    write_checkpoint,
)
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.wire_models import wire_batch, wire_entry

from ckpt_workload import C, answers, feed, workload


def fresh(chunk_size: int = C, blend: bool = True) -> KeyDirectory:
    d = KeyDirectory()
    if blend:
        d.enable_blend_lookup(chunk_size=chunk_size, engine="cpu")
    return d


def restored(path, **kw) -> KeyDirectory:
    d = fresh(**kw)
    with read_checkpoint(path) as ck:
        restore_directory(d, ck)
    return d


# ---------------------------------------------------------------------- file format
def test_sections_round_trip(tmp_path):
    a = np.arange(10, dtype=np.uint32).reshape(5, 2)
    parts = [np.arange(6, dtype=np.int64), np.arange(6, 9, dtype=np.int64)]
    p = tmp_path / "ck"
    stats = write_checkpoint(p, {"x": Section({"k": [1, "two"]}, {"a": a, "p": parts, "e": np.empty(0, np.uint8)}),
                                 "doc_only": Section({"pos": {"partition": 0, "offset": 7}})}, info={"n": 1})
    assert stats.bytes == p.stat().st_size
    with read_checkpoint(p) as ck:
        assert ck.section_names == ["x", "doc_only"] and ck.info == {"n": 1}
        x = ck.section("x")
        assert x.doc == {"k": [1, "two"]}
        np.testing.assert_array_equal(x.array("a"), a)
        np.testing.assert_array_equal(x.array("p"), np.arange(9))
        assert x.array("e").size == 0
        out = np.zeros(20, dtype=np.uint32)
        x.array("a", out)  # read into a larger buffer
        np.testing.assert_array_equal(out[:10], a.reshape(-1))
        assert ck.section("doc_only").doc["pos"]["offset"] == 7
        ck.verify()
        with pytest.raises(CorruptCheckpoint, match="missing"):
            ck.section("nope")


def _damage(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def sample(tmp_path):
    p = tmp_path / "ck"
    write_checkpoint(p, {"s": Section({"a": 1}, {"big": np.arange(50_000, dtype=np.uint32)})})
    return p


def test_every_flipped_byte_region_is_detected(sample):
    size = sample.stat().st_size
    good = sample.read_bytes()
    for offset in (0, 9, 100, size // 2, size - 30, size - 3):  # magic, version, data, toc, trailer
        sample.write_bytes(good)
        _damage(sample, offset, bytes([good[offset] ^ 0xFF]))
        with pytest.raises(CheckpointError):
            with read_checkpoint(sample) as ck:
                ck.verify()


def test_truncated_and_unknown_version(sample):
    good = sample.read_bytes()
    for cut in (0, 5, 16, len(good) // 2, len(good) - 1):
        sample.write_bytes(good[:cut])
        with pytest.raises(CorruptCheckpoint):
            read_checkpoint(sample)
    sample.write_bytes(good[:8] + (99).to_bytes(4, "little") + good[12:])
    with pytest.raises(UnknownCheckpointVersion, match="version 99"):
        read_checkpoint(sample)
    sample.write_bytes(b"LMCKPT\0\0" + good[8:])
    with pytest.raises(CorruptCheckpoint, match="magic"):
        read_checkpoint(sample)


_WRITER = textwrap.dedent("""
    import sys, time, numpy as np
    from blendmatch.index.ckpt_file import Section, write_checkpoint
    def progress(n):
        if n > 8 << 20:
            print("half", flush=True)
            time.sleep(60)
    write_checkpoint(sys.argv[1], {"s": Section({"gen": 2}, {"big": np.ones(16 << 20, dtype=np.uint32)})},
                     progress=progress)
""")


def test_writer_killed_half_way_leaves_previous_checkpoint(tmp_path):
    p = tmp_path / "ck"
    write_checkpoint(p, {"s": Section({"gen": 1}, {"big": np.zeros(1000, dtype=np.uint32)})})
    before = p.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(p)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "half"
        temps = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
        assert temps and os.path.getsize(tmp_path / temps[0]) > 8 << 20
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert p.read_bytes() == before
    with read_checkpoint(p) as ck:
        assert ck.section("s").doc == {"gen": 1}
        ck.verify()
    assert remove_stale_temporaries(p) and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


# ---------------------------------------------------------------------- restore = same answers
@pytest.mark.parametrize("seed,fork", [(0, True), (1, False), (2, True), (3, False)])
def test_restore_answers_exactly_as_before(tmp_path, seed, fork):
    batches = workload(seed, 600)
    d = fresh()
    feed(d, batches[:300])
    p = tmp_path / "ck"
    result = capture(d, p, fork=fork, extra=lambda: {"stream_position": {"topic": "t", "offsets": [5, 9]}})
    assert result.forked is fork and result.bytes == p.stat().st_size
    r = restored(p)
    before = answers(d, seed)
    assert sum(map(len, before["matches"])) > 50  # the workload really matches, with repeats
    assert any(len({m.chunk_hash for m in ms}) > 1 for ms in before["matches"])
    assert answers(r, seed) == before
    # and both go on identically: same rows reused, same occupant order after removals/re-adds
    feed(d, batches[300:])
    feed(r, batches[300:])
    assert answers(r, seed) == answers(d, seed)
    with read_checkpoint(p) as ck:
        assert ck.section("stream_position").doc == {"topic": "t", "offsets": [5, 9]}


def test_replayed_batches_are_duplicates_after_restore(tmp_path):
    batches = workload(7, 200)
    d = fresh()
    feed(d, batches)
    capture(d, tmp_path / "ck")
    r = restored(tmp_path / "ck")
    counts = feed(r, batches)
    assert sum(c.applied for c in counts) == 0
    assert sum(c.duplicates + c.stale for c in counts) == len(batches)
    assert r.stats()["events"]["duplicates"] >= 1
    feed(d, batches)  # the same replay on the original: same answers, same counters
    assert answers(r, 7) == answers(d, 7)


def test_private_tokens_and_blend_disabled(tmp_path):
    d = fresh(blend=False)
    d.apply({"batches": [wire_batch("a", 1, "store", [wire_entry(b"h1", "m", token_ids=[1, 2, 3], token_offset=0)])]})
    capture(d, tmp_path / "ck", fork=False)
    r = restored(tmp_path / "ck", blend=False)
    assert r.get_token_ids([b"h1"])[0].tolist() == [1, 2, 3]
    assert r.list_keys() == d.list_keys()
    with pytest.raises(IncompatibleCheckpoint, match="blend_lookup"):
        restored(tmp_path / "ck")
    d2 = fresh(chunk_size=8)
    capture(d2, tmp_path / "ck8")
    with pytest.raises(IncompatibleCheckpoint, match="chunk_size 8"):
        restored(tmp_path / "ck8")


def test_reporting_instances_survive_restore(tmp_path):
    """LMCache's ``l1_keys_by_instance`` lists every instance with a batch applied since its
    last fence, at 0 when it holds no L1 key: a restore answers the same."""
    d = fresh(blend=False)
    d.apply({"batches": [wire_batch("a", 1, "store", [wire_entry(b"h1", "m")]),
                         wire_batch("a", 2, "delete", [wire_entry(b"h1", "m")]),
                         wire_batch("b", 1, "store", [wire_entry(b"h2", "m")], tier="l2"),
                         wire_batch("c", 1, "store", [wire_entry(b"h3", "m")])]})
    assert d.stats()["l1_keys_by_instance"] == {"a": 0, "b": 0, "c": 1}
    capture(d, tmp_path / "ck", fork=False)
    assert restored(tmp_path / "ck", blend=False).stats()["l1_keys_by_instance"] == {"a": 0, "b": 0, "c": 1}


def test_inspect_reports_and_verifies(tmp_path):
    d = fresh()
    feed(d, workload(4, 50))
    capture(d, tmp_path / "ck", extra=lambda: {"stream_position": {"offset": 3}})
    report = inspect_checkpoint(tmp_path / "ck")
    assert report["version"] == 1 and report["checksums"] == "ok"
    assert report["info"]["chunk_hashes"] == d.stats()["chunk_hashes"]
    assert report["stream_position"] == {"offset": 3}
    assert set(report["sections"]) == {"meta", "gate", "directory", "index", "stream_position"}
    assert abs(report["created"] - time.time()) < 60


def test_l1_section_does_not_depend_on_when_logs_were_compacted():
    """Each instance's L1 chunks are logged in the order they gained a copy, stale entries
    included, until a compaction (bindings.py): two directories that hold the same keys in
    the same order write the same L1 section, whatever their histories."""
    from blendmatch.index.checkpoint import directory_sections

    def entries(*names: bytes) -> list:
        return [wire_entry(h, "m") for h in names]

    a = fresh(blend=False)  # x logged first, its binding gone, then bound again last
    a.apply({"batches": [wire_batch("a", 1, "store", entries(b"w", b"x")),
                         wire_batch("a", 2, "delete", entries(b"x")),
                         wire_batch("a", 3, "store", entries(b"y", b"z")),
                         wire_batch("a", 4, "store", entries(b"x"))]})
    b = fresh(blend=False)  # the same keys, each stored once
    b.apply({"batches": [wire_batch("a", 1, "store", entries(b"w", b"y", b"z")),
                         wire_batch("a", 2, "store", entries(b"x"))]})
    assert a.list_keys(limit=None) == b.list_keys(limit=None)
    assert a._store.l1_chunks_of("a") == [b"w", b"x", b"y", b"z"]
    assert b._store.l1_chunks_of("a") == [b"w", b"y", b"z", b"x"]
    sa, sb = directory_sections(a)[0]["directory"], directory_sections(b)[0]["directory"]
    assert sa.doc["l1_chunks"] == sb.doc["l1_chunks"]
    assert sa.arrays["l1_pos"].tolist() == sb.arrays["l1_pos"].tolist()
