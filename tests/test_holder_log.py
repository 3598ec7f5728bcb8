"""A chunk held by many instances: O(1) holder changes, whole holder sets for lock-free readers
(issue 47, item 3: ``index/holder_log.py``).

- the log against a model (a dict of copies) over seeded random adds, replacements,
  removals and fences crossing the tuple/log threshold both ways; every view taken along
  the way still shows exactly what it showed when taken;
- the directory: adding one more holder does the same work at 40 and at 400 holders
  (counted as Python calls with ``sys.setprofile``, not timed);
- readers that take no lock (``namespace_placements``, ``namespace_ranked``) see, under a
  writer adding and removing holders, only holder sets that existed during their read;
- a checkpoint of big holder sets restores to the same directory, which then changes as the
  original does.
"""

from __future__ import annotations

import random
import sys
import threading

import numpy as np

from blendmatch.index.checkpoint import capture, restore_directory
from blendmatch.index.ckpt_file import read_checkpoint
from blendmatch.index.holder_log import (LOG_FROM, PlacementView, canonical, find, has_private_l1,
                                         with_placement, without_ident, without_private_l1)
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.placements import Placement, is_private_l1, placement_ident
from blendmatch.index.types import BlendNamespace, ObjectKey, pack_kv_rank
from blendmatch.index.wire import parse_event_request
from blendmatch.index.wire_models import wire_batch, wire_entry

C = 4
NS = BlendNamespace("m", "", 1)
ROW = [11, 12, 13, 14]


def _random_placement(rng: random.Random, n_inst: int) -> Placement:
    if rng.random() < 0.1:
        return Placement("", 0, rng.choice(["l1", "l2"]), rng.choice(["pool-a", "pool-b"]), rng.randrange(3), True)
    return Placement(f"i{rng.randrange(n_inst):03d}", rng.randrange(2), rng.choice(["l1", "l1", "l2"]),
                     rng.choice(["cpu", "disk"]), rng.randrange(3), False)


def test_log_against_a_model_and_views_are_snapshots():
    rng = random.Random(47)
    pls: object = ()
    model: dict[tuple[str, str, str], Placement] = {}
    taken: list[tuple[object, set[Placement]]] = []
    grew = shrank = False
    for step in range(6000):
        # phases: mostly adds, then mostly removals, so the size crosses LOG_FROM both ways
        grow = (step // 600) % 2 == 0
        r = rng.random()
        if r < (0.75 if grow else 0.25):
            p = _random_placement(rng, 60)
            if model.get(placement_ident(p)) == p:
                continue
            pls, old = with_placement(pls, p)
            assert old == model.get(placement_ident(p))
            model[placement_ident(p)] = p
        elif r < 0.95 or not model:
            ident = rng.choice(list(model)) if model and rng.random() < 0.8 else placement_ident(
                _random_placement(rng, 60))
            pls, gone = without_ident(pls, ident)
            assert gone == model.pop(ident, None)
        else:
            inst = f"i{rng.randrange(60):03d}"
            pls, gone = without_private_l1(pls, inst)
            want = [q for q in model.values() if is_private_l1(q, inst)]
            assert sorted(gone) == sorted(want)
            for q in want:
                del model[placement_ident(q)]
        grew |= isinstance(pls, PlacementView)
        shrank |= grew and type(pls) is tuple and len(model) > 0
        assert len(pls) == len(model) and set(pls) == set(model.values())
        assert len(list(pls)) == len(model)  # no copy twice
        if type(pls) is tuple:
            assert list(pls) == sorted(pls, key=placement_ident)
        assert canonical(pls) == tuple(sorted(model.values(), key=placement_ident))
        for _ in range(3):
            ident = placement_ident(_random_placement(rng, 60))
            assert find(pls, ident) == model.get(ident)
        inst = f"i{rng.randrange(60):03d}"
        assert has_private_l1(pls, inst) == any(is_private_l1(q, inst) for q in model.values())
        if step % 7 == 0:
            taken.append((pls, set(model.values())))
    assert grew and shrank, "the walk must cross the tuple/log threshold both ways"
    assert max(len(s) for _, s in taken) > 2 * LOG_FROM
    for view, seen in taken:  # later changes never show through an earlier view
        assert set(view) == seen and len(view) == len(seen)


def _store(d: KeyDirectory, inst: str, seq: int, hashes: range, kind: str = "store") -> None:
    entries = [wire_entry(i.to_bytes(8, "big"), "m", pack_kv_rank(1), size_bytes=100,
                          token_ids=(ROW if kind == "store" else None), token_offset=(0 if kind == "store" else -1))
               for i in hashes]
    d.apply(parse_event_request({"batches": [wire_batch(inst, seq, kind, entries)]}))


def _calls_to_add_holder(holders: int) -> int:
    """Python calls (and C calls) made by applying one more holder's STORE of a chunk that
    ``holders`` instances hold already."""
    d = KeyDirectory()
    d.enable_blend_lookup(C, engine="cpu")
    for n in range(holders):
        _store(d, f"inst-{n:04d}", 1, range(1))
    request = parse_event_request({"batches": [wire_batch("inst-new", 1, "store", [
        wire_entry((0).to_bytes(8, "big"), "m", pack_kv_rank(1), size_bytes=100, token_ids=ROW, token_offset=0)])]})
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += 1

    sys.setprofile(count)
    try:
        d.apply(request)
    finally:
        sys.setprofile(None)
    assert len(d.lookup([ObjectKey((0).to_bytes(8, "big"), "m", pack_kv_rank(1), 0, "")])[0]) == holders + 1
    return calls


def test_adding_a_holder_costs_the_same_at_40_and_400_holders():
    small, big = _calls_to_add_holder(40), _calls_to_add_holder(400)
    # O(holders) per add (the holder tuple copied, sorted and hashed) makes ``big`` grow by
    # hundreds of calls; a constant-work add differs by a few at most (dict growth, compaction)
    assert big <= small + 20, (small, big)


def test_lock_free_readers_see_only_holder_sets_that_existed():
    d = KeyDirectory()
    d.enable_blend_lookup(C, engine="cpu")
    h = (0).to_bytes(8, "big")
    insts = [f"inst-{k:03d}" for k in range(80)]
    seqs = dict.fromkeys(insts, 0)
    for inst in insts[:40]:
        seqs[inst] += 1
        _store(d, inst, seqs[inst], range(1))
    held = set(insts[:40])
    history: list[frozenset[str]] = [frozenset(held)]  # states in order; the writer appends after each
    rng = random.Random(4747)
    stop = threading.Event()
    seen: list[tuple[int, frozenset[str], int]] = []
    ranked_seen: list[tuple[int, frozenset[str], int]] = []

    def writer() -> None:
        for _ in range(3000):
            inst = rng.choice(insts)
            seqs[inst] += 1
            if inst in held:
                _store(d, inst, seqs[inst], range(1), "delete")
                held.discard(inst)
            else:
                _store(d, inst, seqs[inst], range(1))
                held.add(inst)
            history.append(frozenset(held))
        stop.set()

    def reader(out, ranked: bool) -> None:
        while not stop.is_set():
            lo = len(history)
            if ranked:
                got = d.namespace_ranked([h], NS)[0]
                ids = frozenset(p.instance_id for p in got.order) if got is not None else frozenset()
            else:
                ids = frozenset(p.instance_id for p in d.namespace_placements([h], NS)[0])
            out.append((lo, ids, len(history)))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader, args=(seen, False)),
               threading.Thread(target=reader, args=(ranked_seen, True))]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: interleave reads with writes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    assert len(history) == 3001 and len(seen) > 50 and len(ranked_seen) > 50
    assert max(len(s) for s in history) > 2 * LOG_FROM
    # a read began when history had ``lo`` states (the newest possibly already replaced) and
    # ended before it had ``hi + 1``: what it saw must be one of those states, whole
    for lo, ids, hi in seen + ranked_seen:
        assert ids in history[max(0, lo - 1):hi + 1], (lo, hi, sorted(ids))


def _fleet_directory(n: int) -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(C, engine="cpu")
    for k in range(n):
        _store(d, f"inst-{k:03d}", 1, range(3))
    return d


def _state(d: KeyDirectory) -> tuple:
    keys = [ObjectKey(i.to_bytes(8, "big"), "m", pack_kv_rank(1), 0, "") for i in range(3)]
    stats = d.stats()
    counts = {k: v for k, v in stats.items() if k not in ("blend_index", "l1_keys_by_instance")}
    l1 = {i: n for i, n in stats["l1_keys_by_instance"].items() if n}  # a restore lists no instance at 0
    return (d.lookup(keys), [tuple(sorted(p)) for p in d.namespace_placements([k.chunk_hash for k in keys], NS)],
            d.list_keys(), counts, l1, d.blend_match(np.asarray(ROW, dtype=np.uint32), NS))


def test_checkpoint_of_big_holder_sets_round_trips_and_changes_alike(tmp_path):
    d = _fleet_directory(3 * LOG_FROM)
    _store(d, "inst-005", 2, range(1), "delete")  # a dead slot in the log
    d.fence_instance("inst-007")
    capture(d, tmp_path / "ck", fork=False)
    r = KeyDirectory()
    r.enable_blend_lookup(C, engine="cpu")
    with read_checkpoint(tmp_path / "ck") as ck:
        restore_directory(r, ck)
    assert _state(r) == _state(d)
    pls = d.lookup([ObjectKey((1).to_bytes(8, "big"), "m", pack_kv_rank(1), 0, "")])[0]
    assert len(pls) == 3 * LOG_FROM - 1 and list(pls) == sorted(pls, key=placement_ident)
    for x in (d, r):  # the same changes on both: the same result
        _store(x, "inst-new", 1, range(3))
        _store(x, "inst-009", 2, range(2), "delete")
        x.fence_instance("inst-010")
    assert _state(r) == _state(d)
