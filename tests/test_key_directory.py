"""KeyDirectory: every row of the lifecycle (index/ingest.py, index/bindings.py), the gate, placements,
fencing, namespaces, reads, memory sharing with the index, and all-or-nothing requests."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from blendmatch.index.wire import EventValidationError
from blendmatch.index.wire_models import wire_batch, wire_entry
from blendmatch.index.key_directory import (
    SHARED_POOL_INSTANCE,
    ApplyCounts,
    BlendLookupDisabled,
    KeyDirectory,
    KeyPlacements,
    Placement,
)
from blendmatch.index.types import BlendMatch, BlendNamespace, ObjectKey, pack_kv_rank

from ckpt_workload import token_offsets

C = 4
WS1 = pack_kv_rank(1)
NS = BlendNamespace("m", "", 1)
X = [1, 2, 3, 4]
Y = [5, 6, 7, 8]


def H(i: int) -> bytes:
    return i.to_bytes(8, "big")


class Feed:
    """Sends batches to a directory with per-instance sequence numbers."""

    def __init__(self, d: KeyDirectory) -> None:
        self.d = d
        self.seq: dict[str, int] = {}

    def send(self, kind: str, inst: str, *entries: dict, incarnation: int = 0, **kw) -> ApplyCounts:
        self.seq[inst] = self.seq.get(inst, 0) + 1
        return self.d.apply({"batches": [wire_batch(inst, self.seq[inst], kind, list(entries),
                                                    incarnation=incarnation, **kw)]})

    def store(self, inst: str, *entries: dict, **kw) -> ApplyCounts:
        return self.send("store", inst, *entries, **kw)

    def delete(self, inst: str, *entries: dict, **kw) -> ApplyCounts:
        return self.send("delete", inst, *entries, **kw)


def E(i: int, tokens=None, offset: int = -1, model: str = "m", kv_rank: int = WS1, salt: str = "",
      group: int = 0, size: int = 100) -> dict:
    return wire_entry(H(i), model, kv_rank, object_group_id=group, cache_salt=salt, size_bytes=size,
                      token_ids=tokens, token_offset=offset)


@pytest.fixture
def d() -> KeyDirectory:
    directory = KeyDirectory()
    directory.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    return directory


@pytest.fixture
def feed(d: KeyDirectory) -> Feed:
    return Feed(d)


def hits(d: KeyDirectory, tokens, ns: BlendNamespace = NS) -> list[tuple[bytes, int, int]]:
    return [(m.chunk_hash, m.old_st, m.cur_st) for m in d.blend_match(tokens, ns)]


# ----------------------------------------------------------------------------- lifecycle


def test_first_content_claims_for_every_keys_namespace(d, feed):
    other = BlendNamespace("n", "", 1)
    feed.store("a", E(1), E(1, model="n"))  # two keys, no content yet
    assert hits(d, X) == [] and hits(d, X, other) == []
    feed.store("a", E(1, X, offset=8))
    assert hits(d, X) == [(H(1), 8, 0)]
    assert hits(d, X, other) == [(H(1), 8, 0)]


def test_key_joining_a_binding_with_content_claims_without_tokens(d, feed):
    ws2 = BlendNamespace("m", "", 2)
    feed.store("a", E(1, X, offset=0))
    assert hits(d, X, ws2) == []
    feed.store("b", E(1, kv_rank=pack_kv_rank(2, 1)))  # no tokens on this STORE
    assert hits(d, X, ws2) == [(H(1), 0, 0)]


def test_identical_content_updates_the_offset(d, feed):
    feed.store("a", E(1, X, offset=0))
    feed.store("a", E(1, X, offset=12))
    assert hits(d, X) == [(H(1), 12, 0)]


def test_unknown_offset_never_downgrades_a_known_one(d, feed):
    feed.store("a", E(1, X, offset=12))
    feed.store("b", E(1, X, offset=-1))
    assert hits(d, X) == [(H(1), 12, 0)]
    assert token_offsets(d, [H(1)]) == [12]


def test_unknown_offset_is_never_matchable_until_known(d, feed):
    feed.store("a", E(1, X, offset=-1))
    assert hits(d, X) == []
    assert d.get_token_ids([H(1)])[0].tolist() == X  # bound, just not offered
    feed.store("a", E(1, X, offset=4))
    assert hits(d, X) == [(H(1), 4, 0)]


def test_different_content_retires_the_old_fingerprint_for_every_namespace(d, feed):
    other = BlendNamespace("n", "", 1)
    feed.store("a", E(1, X, offset=0), E(1, model="n"))
    assert hits(d, X) and hits(d, X, other)
    feed.store("a", E(1, Y, offset=4))
    for ns in (NS, other):
        assert hits(d, X, ns) == []
        assert hits(d, Y, ns) == [(H(1), 4, 0)]
    assert d.blend_index.stats()["num_contents"] == 1


def test_different_content_takes_its_own_offset(d, feed):
    feed.store("a", E(1, X, offset=8))
    feed.store("a", E(1, Y, offset=-1))  # the old offset belongs to the old content
    assert hits(d, Y) == [] and token_offsets(d, [H(1)]) == [-1]


def test_claim_goes_with_the_last_key_of_its_namespace_any_rank_or_group(d, feed):
    ws2 = BlendNamespace("m", "", 2)
    feed.store("a", E(1, X, offset=0, kv_rank=pack_kv_rank(2, 0)), E(1, kv_rank=pack_kv_rank(2, 1)),
               E(1, kv_rank=pack_kv_rank(2, 1), group=3))
    feed.delete("a", E(1, kv_rank=pack_kv_rank(2, 0)))
    feed.delete("a", E(1, kv_rank=pack_kv_rank(2, 1)))
    assert hits(d, X, ws2) == [(H(1), 0, 0)]  # the group-3 key still claims
    feed.delete("a", E(1, kv_rank=pack_kv_rank(2, 1), group=3))
    assert hits(d, X, ws2) == []
    assert d.blend_index.stats()["num_chunks"] == 0
    assert d.get_token_ids([H(1)]) == [None]  # the binding died with its last key


def test_claim_goes_per_namespace_other_namespaces_keep_theirs(d, feed):
    other = BlendNamespace("n", "", 1)
    feed.store("a", E(1, X, offset=0), E(1, model="n"))
    feed.delete("a", E(1))
    assert hits(d, X) == []
    assert hits(d, X, other) == [(H(1), 0, 0)]


def test_key_lives_while_any_placement_remains(d, feed):
    feed.store("a", E(1, X, offset=0), tier="l1", backend="cpu")
    feed.store("a", E(1), tier="l2", backend="disk")
    feed.delete("a", E(1), tier="l1", backend="cpu")
    assert hits(d, X) == [(H(1), 0, 0)]
    feed.delete("a", E(1), tier="l2", backend="disk")
    assert hits(d, X) == []


def test_fencing_drops_l1_and_the_claims_of_keys_left_without_placements(d, feed):
    feed.store("a", E(1, X, offset=0))  # L1 only
    feed.store("a", E(2, Y, offset=4))
    feed.store("a", E(2), tier="l2", backend="disk")  # E(2) also on L2
    result = d.fence_instance("a")
    assert result.placements == 2 and result.keys == 1
    assert hits(d, X) == []
    assert hits(d, Y) == [(H(2), 4, 0)]
    assert d.lookup([ObjectKey(H(2), "m", WS1)]) == [(Placement("a", 0, "l2", "disk", 100, False),)]
    assert d.stats()["l1_keys_per_instance"] == {}
    assert d.fence_instance("a") == (0, 0)  # idempotent


def test_fencing_leaves_other_instances_alone(d, feed):
    feed.store("a", E(1, X, offset=0))
    feed.store("b", E(1))
    d.fence_instance("a")
    assert hits(d, X) == [(H(1), 0, 0)]
    assert d.stats()["l1_keys_per_instance"] == {"b": 1}


def test_fencing_skips_l1_log_entries_of_chunks_gone_or_moved(d, feed):
    """The per-instance L1 log (bindings.py) is not cleaned on a delete: a fence walks
    entries whose chunk is unbound, re-bound without an L1 copy there, or logged twice."""
    feed.store("a", E(1, X, offset=0), E(2, Y, offset=4), E(3))
    feed.store("a", E(3, group=1))  # a second key of chunk 3 on a: logged twice
    feed.delete("a", E(1))  # chunk 1 unbound: a stale entry
    feed.delete("a", E(2))
    feed.store("b", E(2, Y, offset=4))  # chunk 2 re-bound, with b's copy only
    store = d._store
    assert store.l1_log["a"].count(H(3)) == 2 and H(1) in store.l1_log["a"]
    assert d._l1_chunks == {"a": {H(3)}, "b": {H(2)}}
    assert d.fence_instance("a") == (2, 2)  # chunk 3's two keys; nothing else touched
    assert hits(d, Y) == [(H(2), 4, 0)]
    assert d._l1_chunks == {"b": {H(2)}} and "a" not in store.l1_log


def test_l1_logs_stay_bounded_under_churn_and_go_with_the_last_key(d, feed):
    """Store-and-delete churn on one instance (one chunk kept throughout): its log is
    compacted back, never holding more than twice its L1 keys plus the slack; the log goes
    when the instance's last L1 key goes; the checkpoint state lists each chunk once."""
    from blendmatch.index.bindings import _L1_LOG_SLACK

    feed.store("a", E(0))
    store = d._store
    longest = 0
    for round_ in range(6):
        batch = [E(1 + round_ * 3000 + i) for i in range(3000)]
        feed.store("a", *batch)
        feed.delete("a", *batch)
        longest = max(longest, len(store.l1_log["a"]))
    assert longest <= 2 * 1 + _L1_LOG_SLACK  # 18,001 entries logged in all
    assert d.stats()["l1_keys_per_instance"] == {"a": 1}
    assert d.export_state()["l1_chunks"] == {"a": [H(0)]}
    feed.delete("a", E(0))
    assert "a" not in store.l1_log and d.export_state()["l1_chunks"] == {}


def test_stores_before_enabling_are_not_back_filled():
    d = KeyDirectory()
    feed = Feed(d)
    feed.store("a", E(1, X, offset=0))
    with pytest.raises(BlendLookupDisabled):
        d.blend_match(X, NS)
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    assert hits(d, X) == []
    feed.store("b", E(1, model="n"))  # a key joining a pre-enable binding: still not indexed
    assert hits(d, X, BlendNamespace("n", "", 1)) == []
    feed.store("a", E(1, X, offset=-1))  # the content again, after enabling: now indexed
    assert hits(d, X) == [(H(1), 0, 0)]
    assert hits(d, X, BlendNamespace("n", "", 1)) == [(H(1), 0, 0)]


def test_token_ids_outside_uint32_leave_the_binding_unfilled(d, feed, caplog):
    with caplog.at_level(logging.WARNING, logger="blendmatch.index.key_directory"):
        counts = feed.store("a", E(1, [1, 2, 3, 2**32], offset=0), E(2, [-1, 2, 3, 4], offset=0))
    assert counts == ApplyCounts(1, 0, 0)
    assert "outside" in caplog.text
    assert d.get_token_ids([H(1), H(2)]) == [None, None]
    assert d.lookup([ObjectKey(H(1), "m", WS1)])[0]  # the placement is applied
    assert d.stats()["events"]["entries_unfilled"] == 2


def test_unfilled_store_keeps_existing_content_and_still_claims(d, feed):
    feed.store("a", E(1, X, offset=0))
    feed.store("b", E(1, [2**40] * C, offset=4, model="n"))
    assert d.get_token_ids([H(1)])[0].tolist() == X
    assert hits(d, X, BlendNamespace("n", "", 1)) == [(H(1), 0, 0)]  # joined; offset unchanged


def test_content_of_the_wrong_length_is_bound_but_not_indexed(d, feed):
    feed.store("a", E(1, [1, 2, 3, 4, 5], offset=0))
    assert d.get_token_ids([H(1)])[0].tolist() == [1, 2, 3, 4, 5]
    assert hits(d, [1, 2, 3, 4, 5]) == []
    assert d.blend_index.stats()["num_chunks"] == 0


# ----------------------------------------------------------------------------- namespaces


@pytest.mark.parametrize("stored, query, expect", [
    (dict(), NS, True),
    (dict(salt="s"), NS, False),
    (dict(), BlendNamespace("m", "s", 1), False),
    (dict(salt="s"), BlendNamespace("m", "s", 1), True),
    (dict(model="n"), NS, False),
    (dict(), BlendNamespace("n", "", 1), False),
    (dict(kv_rank=pack_kv_rank(2)), NS, False),
    (dict(), BlendNamespace("m", "", 2), False),
    (dict(kv_rank=pack_kv_rank(2, 1, 2, 1)), BlendNamespace("m", "", 2), True),
])
def test_namespace_isolation(d, feed, stored, query, expect):
    feed.store("a", E(1, X, offset=0, **stored))
    assert bool(hits(d, X, query)) is expect


def test_same_content_two_namespaces_each_sees_its_own_chunk(d, feed):
    feed.store("a", E(1, X, offset=0), E(2, X, offset=8, salt="s"))
    assert hits(d, X) == [(H(1), 0, 0)]
    assert hits(d, X, BlendNamespace("m", "s", 1)) == [(H(2), 8, 0)]


# ----------------------------------------------------------------------------- gate


def test_duplicate_batches_are_dropped(d):
    batch = wire_batch("a", 1, "store", [E(1, X, offset=0)])
    assert d.apply({"batches": [batch]}) == (1, 0, 0)
    assert d.apply({"batches": [batch, wire_batch("a", 1, "delete", [E(1)])]}) == (0, 2, 0)
    assert hits(d, X) == [(H(1), 0, 0)]


def test_stale_incarnation_is_dropped(d):
    d.apply({"batches": [wire_batch("a", 1, "store", [E(1, X, offset=0)], incarnation=2)]})
    assert d.apply({"batches": [wire_batch("a", 9, "delete", [E(1)], incarnation=1)]}) == (0, 0, 1)
    assert hits(d, X) == [(H(1), 0, 0)]
    assert d.stats()["events"]["stale"] == 1


def test_higher_incarnation_fences_l1_then_applies(d):
    d.apply({"batches": [wire_batch("a", 5, "store", [E(1, X, offset=0), E(2, Y, offset=0)])]})
    d.apply({"batches": [wire_batch("a", 6, "store", [E(2)], tier="l2", backend="disk")]})
    counts = d.apply({"batches": [wire_batch("a", 1, "store", [E(3, [9, 9, 9, 9], offset=0)], incarnation=1)]})
    assert counts == (1, 0, 0)
    assert hits(d, X) == []  # fenced: L1 only
    assert hits(d, Y) == [(H(2), 0, 0)]  # kept: on L2
    assert hits(d, [9, 9, 9, 9]) == [(H(3), 0, 0)]  # the new incarnation's batch applied
    stats = d.stats()
    assert stats["instances"]["a"] == {"incarnation": 1, "last_seq": 1}
    assert stats["events"]["fences"] == 1
    assert stats["l1_keys_per_instance"] == {"a": 1}


def test_gaps_are_admitted_and_counted(d, caplog):
    d.apply({"batches": [wire_batch("a", 1, "store", [E(1, X, offset=0)])]})
    with caplog.at_level(logging.WARNING):
        assert d.apply({"batches": [wire_batch("a", 5, "store", [E(2, Y, offset=0)])]}) == (1, 0, 0)
    assert "gap" in caplog.text
    assert hits(d, Y) == [(H(2), 0, 0)]
    events = d.stats()["events"]
    assert events["gaps"] == 1 and events["missed"] == 3


def test_an_invalid_batch_rejects_the_whole_request(d):
    good = wire_batch("a", 1, "store", [E(1, X, offset=0)])
    bad = wire_batch("a", 2, "store", [E(2, Y, offset=0), E(3, offset=-2)])
    with pytest.raises(EventValidationError) as err:
        d.apply({"batches": [good, bad]})
    assert err.value.field == "batches[1].entries[1].token_offset"
    assert d.stats()["keys"] == 0 and d.stats()["instances"] == {}
    assert hits(d, X) == []
    assert d.apply({"batches": [good]}) == (1, 0, 0)  # the gate saw nothing of it


def test_one_batch_is_a_run_of_one(d):
    assert d.apply({"batches": [wire_batch("a", 1, "store", [E(1, X, offset=0)])]}) == (1, 0, 0)
    assert d.apply({"batches": [wire_batch("a", 1, "store", [E(1, X, offset=0)])]}) == (0, 1, 0)


def test_access_and_config_batches(d):
    counts = d.apply({"batches": [
        wire_batch("a", 1, "access", [E(1)], backend=""),
        wire_batch("a", 2, "config", [], backend="cpu", capacity_bytes=1 << 30, capacity_revision=3),
        wire_batch("a", 3, "config", [], backend="cpu", capacity_bytes=1 << 20, capacity_revision=2),
    ]})
    assert counts == (3, 0, 0)
    stats = d.stats()
    assert stats["keys"] == 0 and stats["events"]["entries_accessed"] == 1
    assert stats["capacity"] == [{"instance_id": "a", "tier": "l1", "backend": "cpu",
                                  "capacity_bytes": 1 << 30, "capacity_revision": 3, "incarnation": 0,
                                  "shared": False}]


def _config(inst, seq, tier, backend, cap, rev, incarnation=0, shared=False):
    return wire_batch(inst, seq, "config", [], tier=tier, backend=backend, capacity_bytes=cap,
                      capacity_revision=rev, incarnation=incarnation, shared=shared)


def _declared(d, inst="a"):
    return sorted((r["tier"], r["backend"], r["capacity_bytes"]) for r in d.stats()["capacity"]
                  if r["instance_id"] == inst)


def test_capacity_declaration_newer_stamp_replaces_equal_extends_older_dropped(d):
    d.apply({"batches": [_config("a", 1, "l1", "dram", 100, 1), _config("a", 2, "l2", "fs", 0, 1, shared=True)]})
    assert _declared(d) == [("l1", "dram", 100), ("l2", "fs", 0)]  # equal stamp extends
    d.apply({"batches": [_config("a", 3, "l1", "dram", 50, 2)]})
    assert _declared(d) == [("l1", "dram", 50)]  # newer stamp: a fresh declaration, l2 retired
    d.apply({"batches": [_config("a", 4, "l1", "cxl", 9, 1)]})
    assert _declared(d) == [("l1", "dram", 50)]  # older revision: a straggler, dropped
    d.apply({"batches": [_config("a", 1, "l1", "dram", 7, 0, incarnation=1)]})
    assert _declared(d) == [("l1", "dram", 7)]  # a higher incarnation wins over any revision


def test_capacity_fields_on_non_config_batches_mean_nothing(d, feed):
    feed.store("a", E(1, X, offset=0), capacity_bytes=0, capacity_revision=0)
    feed.delete("a", E(1), capacity_bytes=5, capacity_revision=9)
    assert d.stats()["capacity"] == []


def test_usage_joins_used_bytes_to_declared_capacity(d, feed):
    d.apply({"batches": [_config("a", 1, "l1", "dram", 1000, 1), _config("a", 2, "l2", "fs", 4000, 1, shared=True),
                         _config("b", 1, "l2", "fs", 4000, 1, shared=True)]})
    feed.seq.update(a=2, b=1)
    feed.store("a", E(1, size=100), E(2, size=150), backend="dram")
    feed.store("a", E(1, size=120), backend="dram")  # the same copy again: replaced, not added
    feed.store("b", E(3, size=400), tier="l2", backend="fs", shared=True)
    st = d.stats()
    assert (st["l1_count"], st["l1_size_bytes"], st["l2_count"], st["l2_size_bytes"]) == (2, 270, 1, 400)
    usage = d.usage(registered=["a", "c"])
    by_id = {i["instance_id"]: i for i in usage["instances"]}
    assert set(by_id) == {"a", "b", "c"}
    assert by_id["a"]["modules"] == [{"tier": "l1", "backend": "dram", "shared": False, "used_bytes": 270,
                                      "capacity_bytes": 1000, "usage_ratio": 0.27}]
    assert by_id["b"]["registered"] is False and by_id["b"]["declared_capacity"] is True
    assert by_id["c"] == {"instance_id": "c", "registered": True, "declared_capacity": False, "modules": []}
    assert usage["shared_modules"] == [{"tier": "l2", "backend": "fs", "shared": True, "used_bytes": 400,
                                        "capacity_bytes": 4000, "usage_ratio": 0.1}]
    feed.delete("a", E(2), backend="dram")
    assert d.instance_usage("a", True)["modules"][0]["used_bytes"] == 120
    before = (d.usage(["a"]), d.stats()["l1_size_bytes"], d.stats()["l2_count"])
    d.rebuild_usage()  # the incremental ledger equals a walk of the placements
    assert (d.usage(["a"]), d.stats()["l1_size_bytes"], d.stats()["l2_count"]) == before
    assert d.instance_usage("zzz", False) is None
    d.drop_instance("a")
    st = d.stats()
    assert (st["l1_count"], st["l1_size_bytes"]) == (0, 0)
    assert d.instance_usage("a", False) is None  # capacity forgotten, bytes fenced


def test_drop_instance_fences_and_forgets_the_cursor(d, feed):
    feed.store("a", E(1, X, offset=0), incarnation=5)
    feed.store("a", E(2, Y, offset=4), tier="l2", backend="fs", incarnation=5)
    d.drop_instance("a")
    assert d.stats()["instances"] == {}
    assert hits(d, X) == [] and hits(d, Y) == [(H(2), 4, 0)]  # L1 fenced, L2 kept
    # a reconnect starts fresh at any incarnation and seq (not stale, not a duplicate)
    assert d.apply({"batches": [wire_batch("a", 1, "store", [E(1, X, offset=0)], incarnation=1)]}) == (1, 0, 0)


def test_entry_counts_and_not_indexable_reasons(d, caplog):
    entries = [E(1, X, offset=0), E(2, [1, 2, 3], offset=0), E(3, Y, offset=-1),
               E(4, X, offset=0, kv_rank=pack_kv_rank(0, 0)), E(5)]
    entries.append(wire_entry(H(6), "m", WS1, token_ids=[1, 2, 3, 1 << 33], token_offset=0))
    with caplog.at_level(logging.WARNING, logger="blendmatch.index.key_directory"):
        report = d.apply_detailed({"batches": [wire_batch("a", 1, "store", entries),
                                               wire_batch("a", 1, "store", entries)]})
        d.apply_detailed({"batches": [wire_batch("a", 2, "store", [E(7, [1], offset=0)])]})
    assert report.counts == (1, 1, 0)
    assert report.entries_applied == 6
    assert report.not_indexable == {"tokens_outside_uint32": 1, "wrong_length": 1, "world_size_0": 1,
                                    "token_offset_unknown": 1}
    assert report.as_wire()["entries_not_indexable"] == report.not_indexable
    assert d.stats()["events"]["entries_not_indexable"]["wrong_length"] == 2
    assert sum("wrong_length" in r.getMessage() for r in caplog.records) == 1  # once per instance and reason
    # offset -1 on content whose offset is known is indexable (never downgrades)
    again = d.apply_detailed({"batches": [wire_batch("a", 3, "store", [E(1, X, offset=-1)])]})
    assert again.not_indexable == {}


def test_world_size_0_content_is_counted_and_never_claimed(d, feed):
    """One rule (indexable.py) decides the counter and the claim: a key of world size 0 is
    counted as not indexable and its namespace is never claimed, on any store path."""
    ws0 = pack_kv_rank(0, 0)
    ns0 = BlendNamespace("m", "", 0)
    feed.store("a", E(1, X, offset=0, kv_rank=ws0))  # a new binding, vector path
    feed.store("a", E(2, Y, offset=0), E(2, kv_rank=ws0))  # a ws0 key joins content, same batch
    feed.store("a", E(3, [9, 9, 9, 9], offset=0, kv_rank=ws0), E(3, [9, 9, 9, 9], offset=0))  # one by one
    index = d.blend_index.stats()
    assert index["num_claims"] == 2 and index["num_namespaces"] == 1
    assert hits(d, X, ns0) == [] and hits(d, Y, ns0) == [] and hits(d, [9, 9, 9, 9], ns0) == []
    assert hits(d, Y) == [(H(2), 0, 0)] and hits(d, [9, 9, 9, 9]) == [(H(3), 0, 0)]
    assert d.stats()["events"]["entries_not_indexable"]["world_size_0"] == 3
    # content stays bound (lookups by key still see it)
    assert [t.tolist() for t in d.get_token_ids([H(1)])] == [X]


# ----------------------------------------------------------------------------- placements


def test_shared_pool_placements_are_deduplicated_across_reporters(d, feed):
    feed.store("a", E(1, X, offset=0, size=10), tier="l2", backend="redis", shared=True)
    feed.store("b", E(1, size=11), tier="l2", backend="redis", shared=True)
    assert d.lookup([ObjectKey(H(1), "m", WS1)]) == [
        (Placement(SHARED_POOL_INSTANCE, 0, "l2", "redis", 11, True),)]
    assert d.stats()["placements"] == 1
    feed.delete("b", E(1), tier="l2", backend="redis", shared=True)  # any reporter drops it
    assert d.lookup([ObjectKey(H(1), "m", WS1)]) == [()]
    assert hits(d, X) == []


def test_fencing_keeps_shared_pool_placements_even_in_l1(d, feed):
    feed.store("a", E(1, X, offset=0), tier="l1", backend="pool", shared=True)
    d.fence_instance("a")
    assert hits(d, X) == [(H(1), 0, 0)]


def test_private_placements_are_per_instance(d, feed):
    feed.store("b", E(1, size=5), tier="l2", backend="disk")
    feed.store("a", E(1, size=7), tier="l1", backend="cpu")
    feed.store("a", E(1, size=8), tier="l1", backend="cpu")  # replaces a's own placement
    feed.store("a", E(1, size=9), tier="l2", backend="disk")
    assert d.lookup([ObjectKey(H(1), "m", WS1)]) == [(
        Placement("a", 0, "l1", "cpu", 8, False),
        Placement("a", 0, "l2", "disk", 9, False),
        Placement("b", 0, "l2", "disk", 5, False),
    )]
    assert d.stats()["placements"] == 3


def test_lookup_keeps_request_order_and_answers_unknown_keys_empty(d, feed):
    feed.store("a", E(1), E(2, model="n"))
    keys = [ObjectKey(H(2), "n", WS1), ObjectKey(H(9), "m", WS1), ObjectKey(H(1), "m", WS1),
            ObjectKey(H(1), "m", WS1, cache_salt="s")]
    got = d.lookup(keys)
    assert [len(p) for p in got] == [1, 0, 1, 0]


def test_list_keys_filters_and_paginates(d, feed):
    feed.store("a", E(1), E(2), E(3), backend="cpu")
    feed.store("b", E(2), tier="l2", backend="disk")
    everything = d.list_keys(limit=None)
    assert [kp.key.chunk_hash for kp in everything] == [H(1), H(2), H(3)]
    assert isinstance(everything[0], KeyPlacements)
    on_b = d.list_keys(instance_id="b")
    assert [(kp.key.chunk_hash, kp.placements) for kp in on_b] == [
        (H(2), (Placement("b", 0, "l2", "disk", 100, False),))]
    assert [kp.key.chunk_hash for kp in d.list_keys(tier="l1", offset=1, limit=1)] == [H(2)]
    assert d.list_keys(backend="nope") == [] and d.list_keys(limit=0) == []
    with pytest.raises(ValueError, match="tier"):
        d.list_keys(tier="all")
    with pytest.raises(ValueError, match="offset"):
        d.list_keys(offset=-1)


def test_key_page_counts_every_match_and_builds_only_the_page(d, feed, monkeypatch):
    """GET /directory/keys: one scan counts every matching key; only the page's keys are
    built (an ObjectKey per key listed, not per key in the directory)."""
    from blendmatch.index.wire_entries import KeyScope

    feed.store("a", *[E(i) for i in range(1, 8)], backend="cpu")
    feed.store("b", E(2), E(5), tier="l2", backend="disk")
    built = []
    real = KeyScope.object_key
    monkeypatch.setattr(KeyScope, "object_key", lambda self, h: built.append(h) or real(self, h))
    page = d.key_page(offset=2, limit=3)
    assert page.total == 7 and [kp.key.chunk_hash for kp in page.keys] == [H(3), H(4), H(5)]
    assert built == [H(3), H(4), H(5)]
    assert page.keys == d.list_keys(offset=2, limit=3)
    on_l2 = d.key_page(tier="l2", offset=1, limit=5)
    assert on_l2.total == 2 and [(kp.key.chunk_hash, len(kp.placements)) for kp in on_l2.keys] == [(H(5), 1)]
    assert d.key_page(instance_id="nobody").total == 0


def test_stats_shape(d, feed):
    feed.store("a", E(1, X, offset=0), E(2))
    stats = d.stats()
    assert stats["keys"] == 2 and stats["placements"] == 2 and stats["chunk_hashes"] == 2
    assert stats["token_bindings"] == 1
    assert stats["l1_keys_per_instance"] == {"a": 2}
    assert stats["blend_lookup_enabled"] is True
    assert stats["blend_index"]["num_chunks"] == 1
    assert KeyDirectory().stats()["blend_index"] is None


# ----------------------------------------------------------------------------- reads, memory, threads


def test_get_token_ids_returns_copies(d, feed):
    feed.store("a", E(1, X, offset=0))
    tokens = d.get_token_ids([H(1), H(7)])
    assert tokens[0].dtype == np.uint32 and tokens[1] is None
    tokens[0][0] = 99  # the caller owns its copy
    assert d.get_token_ids([H(1)])[0].tolist() == X


def test_directory_shares_the_index_token_row(d, feed):
    feed.store("a", E(1, X, offset=0), E(2, Y, offset=-1))
    index_blocks = d.blend_index._tokens._py_blocks
    indexed = d._store.bindings[H(1)].tokens
    assert not indexed.flags.writeable
    assert any(np.shares_memory(indexed, block) for block in index_blocks)
    private = d._store.bindings[H(2)].tokens  # not indexed (offset unknown): a private copy
    assert not any(np.shares_memory(private, block) for block in index_blocks)
    assert private.base is None or private.flags.owndata or private.base.size == C


def test_unindexed_content_never_pins_the_batch_buffer(d, feed):
    """Content kept privately is a copy, on the bulk path and on the entry-by-entry one."""
    feed.store("a", E(1, X, offset=-1))  # bulk path (new, distinct hashes)
    feed.store("a", E(2), E(2, Y, offset=-1))  # entry by entry (repeated hash)
    feed.store("a", E(1, [7, 7, 7, 7, 7], offset=0))  # existing binding, new content of the wrong length
    for h in (H(1), H(2)):
        tokens = d._store.bindings[h].tokens
        assert tokens.base is None and not tokens.flags.writeable


@pytest.mark.parametrize("form", ["uint32", "int64", "bytes"])
def test_packed_token_ids_apply_like_lists(form):
    """An in-process producer's numpy arrays (or packed bytes) give the same directory and
    index as the same ids in JSON lists, on the bulk path and entry by entry; the directory
    keeps no reference to the producer's buffers."""
    def pack(tokens):
        arr = np.array(tokens, dtype=np.int64 if form == "int64" else "<u4")
        return arr.tobytes() if form == "bytes" else arr

    def entry(conv, i: int, tokens=None, **kw) -> dict:
        e = E(i, **kw)  # wire_entry would turn packed tokens into a list
        if tokens is not None:
            e["token_ids"] = conv(tokens)
        return e

    def feed_all(dd: KeyDirectory, conv) -> None:
        f = Feed(dd)
        f.store("a", entry(conv, 1, X, offset=0), entry(conv, 2, Y, offset=-1), entry(conv, 3, [9, 9], offset=0))
        # a repeated hash: entry by entry
        f.store("a", entry(conv, 4, Y, offset=4), entry(conv, 4, X, offset=8), entry(conv, 5))
        f.store("b", entry(conv, 1, X, offset=0, model="n"))  # an existing binding gains a key

    want, got = KeyDirectory(), KeyDirectory()
    for dd in (want, got):
        dd.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    feed_all(want, list)
    feed_all(got, pack)
    assert type(pack(X)) is (bytes if form == "bytes" else np.ndarray)
    hs = [H(i) for i in range(1, 7)]
    assert [None if t is None else t.tolist() for t in got.get_token_ids(hs)] == \
        [None if t is None else t.tolist() for t in want.get_token_ids(hs)]
    assert token_offsets(got, hs) == token_offsets(want, hs)
    for tokens, ns in ((X, NS), (Y, NS), (X + Y, NS), (X, BlendNamespace("n", "", 1))):
        assert hits(got, tokens, ns) == hits(want, tokens, ns)
    assert got.stats() == want.stats()


def test_enable_twice_is_an_error(d):
    with pytest.raises(RuntimeError, match="already"):
        d.enable_blend_lookup(chunk_size=C)


def test_blend_match_batch(d, feed):
    feed.store("a", E(1, X, offset=0), E(2, Y, offset=4))
    out = d.blend_index.match_batch([(X + Y, NS), (Y, BlendNamespace("n", "", 1))])
    assert out == [[BlendMatch(H(1), 0, 0), BlendMatch(H(2), 4, 4)], []]


def test_batch_with_repeated_chunk_hashes_is_applied_in_order(d):
    d.apply({"batches": [wire_batch("a", 1, "store", [
        E(1, X, offset=0), E(1, Y, offset=4), E(1, kv_rank=pack_kv_rank(2)), E(1, Y, offset=8)])]})
    assert hits(d, X) == []
    assert hits(d, Y) == [(H(1), 8, 0)]
    assert hits(d, Y, BlendNamespace("m", "", 2)) == [(H(1), 8, 0)]


def test_concurrent_ingest_and_lookup():
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    errors: list[BaseException] = []

    def writer(inst: str) -> None:
        try:
            for s in range(1, 40):
                entries = [E(1000 * ord(inst) + 10 * s + k, [s, k, ord(inst), 1], offset=0) for k in range(5)]
                d.apply({"batches": [wire_batch(inst, s, "store", entries)]})
                if s % 5 == 0:
                    d.fence_instance(inst)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def reader() -> None:
        try:
            for s in range(1, 60):
                for m in d.blend_match([s % 39 + 1, 2, ord("a"), 1], NS):
                    assert m.old_st == 0
                d.stats()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in "ab"] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = d.stats()
    assert stats["blend_index"]["num_chunks"] == stats["token_bindings"] == stats["keys"]


def test_restore_sequence_lmcache_misses_is_indexed_here(d, feed):
    """Deliberate difference (docs/lmcache.md): content first stored with offset -1, a second
    key joining, then the first key re-stored at a real offset -> findable here."""
    feed.store("a", E(1, X, offset=-1))
    feed.store("a", E(1, kv_rank=pack_kv_rank(1, 0) | (1 << 16)))  # a second key of the same chunk hash
    assert hits(d, X) == []
    feed.store("a", E(1, X, offset=8))
    assert hits(d, X) == [(H(1), 8, 0)]


def test_a_binding_outlives_its_last_claim_with_its_own_tokens():
    """A chunk kept only by world-size-0 keys (never claimed) after its last claimed key left:
    the index freed its row, so the binding must not keep a view of it (the next content
    stored reused the row, and the chunk's tokens read as another chunk's)."""
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, engine="reference")
    f = Feed(d)
    f.store("a", E(1, X, offset=0), E(1, X, offset=0, kv_rank=0))  # ws 1 (claimed) and ws 0 (not)
    f.delete("a", E(1))  # the claimed key leaves: its claim was the content's last
    f.store("a", E(2, Y, offset=0))  # new content may take the freed row
    assert d.get_token_ids([H(1)])[0].tolist() == X
    assert d.blend_match(np.array(X + Y, dtype=np.uint32), NS) == [BlendMatch(H(2), 0, 4)]
