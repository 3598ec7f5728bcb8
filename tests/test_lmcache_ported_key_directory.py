"""LMCache 0.5.6's key-directory tests (``tests/v1/mp_coordinator/test_key_directory.py`` at
LMCache commit ``08340ea459272bf990c73fa42cb476614a4ee4ad``), ported: one test per LMCache
test, same name. How they are ported, and the differences they assert: ``lmcache_port_support``.
"""

from __future__ import annotations

from typing import Any

import pytest

from blendmatch.index import SHARED_POOL_INSTANCE, UNKNOWN_TOKEN_OFFSET, KeyDirectory, ObjectKey, wire_batch, wire_entry

from lmcache_port_support import NS, apply_batch, blend_directory, entries, okey, query, tokens_of


def _where(placements) -> list[tuple[str, str]]:
    return [(p.tier, p.backend) for p in placements]


def _keys(d: KeyDirectory, **filters: Any) -> tuple[int, dict[ObjectKey, tuple]]:
    page = d.key_page(**filters)
    return page.total, {kp.key: kp.placements for kp in page.keys}


def test_store_then_lookup():
    """Ports test_key_directory.py::test_store_then_lookup."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)])
    [[p]] = d.lookup([okey(1)])
    assert (p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes) == ("node-a", 1, "l1", "dram", 1024)


def test_lookup_unknown_key_is_empty():
    """Ports test_key_directory.py::test_lookup_unknown_key_is_empty."""
    assert KeyDirectory().lookup([okey(9)]) == [()]


def test_lookup_preserves_request_order():
    """Ports test_key_directory.py::test_lookup_preserves_request_order."""
    d = KeyDirectory()
    apply_batch(d, [okey(2)])
    first, second = d.lookup([okey(1), okey(2)])
    assert first == () and len(second) == 1


def test_restore_updates_size_without_duplicating_placement():
    """Ports test_key_directory.py::test_restore_updates_size_without_duplicating_placement."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, size=100)
    apply_batch(d, [okey(1)], seq=2, size=200)
    [[p]] = d.lookup([okey(1)])
    assert p.size_bytes == 200


def test_same_key_on_two_instances():
    """Ports test_key_directory.py::test_same_key_on_two_instances."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], instance="node-b")
    apply_batch(d, [okey(1)], instance="node-a")
    [placements] = d.lookup([okey(1)])
    assert [p.instance_id for p in placements] == ["node-a", "node-b"]


def test_same_key_on_two_tiers_of_one_instance():
    """Ports test_key_directory.py::test_same_key_on_two_tiers_of_one_instance."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1)
    apply_batch(d, [okey(1)], seq=2, tier="l2", backend="fs")
    assert _where(d.lookup([okey(1)])[0]) == [("l1", "dram"), ("l2", "fs")]


def test_delete_drops_placement_and_empty_record():
    """Ports test_key_directory.py::test_delete_drops_placement_and_empty_record."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1)
    apply_batch(d, [okey(1)], seq=2, kind="delete", size=None)
    assert d.lookup([okey(1)]) == [()]
    stats = d.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (0, 0)
    assert stats["l1_keys_by_instance"]["node-a"] == 0


def test_removal_of_one_tier_keeps_the_other():
    """Ports test_key_directory.py::test_removal_of_one_tier_keeps_the_other."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1)
    apply_batch(d, [okey(1)], seq=2, tier="l2", backend="fs")
    apply_batch(d, [okey(1)], seq=3, kind="delete", size=None)
    assert _where(d.lookup([okey(1)])[0]) == [("l2", "fs")]
    # the L1 count is the fencing index: the key left it although L2 still holds it
    assert d.stats()["l1_keys_by_instance"]["node-a"] == 0


def test_removal_of_unknown_key_is_noop():
    """Ports test_key_directory.py::test_removal_of_unknown_key_is_noop."""
    d = KeyDirectory()
    apply_batch(d, [okey(7)], kind="delete", size=None)
    assert d.stats()["num_keys"] == 0


def test_access_does_not_create_records():
    """Ports test_key_directory.py::test_access_does_not_create_records."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], kind="access", size=None)
    assert d.stats()["num_keys"] == 0


def test_access_batch_allows_empty_backend():
    """Ports test_key_directory.py::test_access_batch_allows_empty_backend."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, size=100)
    apply_batch(d, [okey(1)], seq=2, kind="access", backend="", size=None)
    [[p]] = d.lookup([okey(1)])
    assert (p.backend, p.size_bytes) == ("dram", 100)  # the placement is untouched


def test_placement_bearing_batches_require_backend():
    """Ports test_key_directory.py::test_placement_bearing_batches_require_backend."""
    d = KeyDirectory()
    for kind in ("store", "delete"):
        with pytest.raises(ValueError, match="backend"):
            apply_batch(d, [okey(1)], kind=kind, backend="")
    assert d.stats()["num_keys"] == 0


def test_fence_instance_removes_all_its_placements():
    """Ports test_key_directory.py::test_fence_instance_removes_all_its_placements."""
    d = KeyDirectory()
    apply_batch(d, [okey(1), okey(2)], instance="node-a")
    apply_batch(d, [okey(1)], instance="node-b")
    d.fence_instance("node-a")
    one, two = d.lookup([okey(1), okey(2)])
    assert [p.instance_id for p in one] == ["node-b"] and two == ()
    assert "node-a" not in d.stats()["l1_keys_by_instance"]


def test_fence_unknown_instance_is_noop():
    """Ports test_key_directory.py::test_fence_unknown_instance_is_noop."""
    d = KeyDirectory()
    d.fence_instance("ghost")
    assert d.stats()["num_keys"] == 0


def test_binding_links_on_store_and_drops_on_delete():
    """Ports test_key_directory.py::test_binding_links_on_store_and_drops_on_delete."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tokens=[1, 2])
    assert tokens_of(d, 1) == [[1, 2]]
    apply_batch(d, [okey(1)], seq=2, kind="delete", size=None)
    assert tokens_of(d, 1) == [[]]


def test_binding_survives_until_last_record_of_the_chunk():
    """Ports test_key_directory.py::test_binding_survives_until_last_record_of_the_chunk."""
    d = KeyDirectory()
    rank1 = ObjectKey(bytes([1]) * 4, "m", kv_rank=1)
    apply_batch(d, [okey(1), rank1], seq=1, tokens=[1, 2])
    apply_batch(d, [okey(1)], seq=2, kind="delete", size=None)
    assert tokens_of(d, 1) == [[1, 2]]
    apply_batch(d, [rank1], seq=3, kind="delete", size=None)
    assert tokens_of(d, 1) == [[]]


def test_chunks_bind_independently():
    """Ports test_key_directory.py::test_chunks_bind_independently."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tokens=[1, 2])
    apply_batch(d, [okey(2)], seq=2, tokens=[3, 4])
    apply_batch(d, [okey(1)], seq=3, kind="delete", size=None)
    assert tokens_of(d, 1, 2) == [[], [3, 4]]


def test_token_less_entry_links_empty_binding():
    """Ports test_key_directory.py::test_token_less_entry_links_empty_binding."""
    d = KeyDirectory()
    rank1 = ObjectKey(bytes([1]) * 4, "m", kv_rank=1)
    apply_batch(d, [rank1], seq=1)
    assert tokens_of(d, 1) == [[]]
    apply_batch(d, [okey(1)], seq=2, tokens=[1, 2])
    assert tokens_of(d, 1) == [[1, 2]]
    apply_batch(d, [okey(1)], seq=3, kind="delete", size=None)
    assert tokens_of(d, 1) == [[1, 2]]  # the token-less key still holds the chunk


def test_untagged_record_heals_on_restore():
    """Ports test_key_directory.py::test_untagged_record_heals_on_restore."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1)
    assert tokens_of(d, 1) == [[]]
    apply_batch(d, [okey(1)], seq=2, tokens=[1, 2])
    assert tokens_of(d, 1) == [[1, 2]]
    apply_batch(d, [okey(1)], seq=3, kind="delete", size=None)
    assert tokens_of(d, 1) == [[]]


def test_binding_records_the_chunks_token_offset():
    """Ports test_key_directory.py::test_binding_records_the_chunks_token_offset."""
    d = blend_directory(2)
    apply_batch(d, [okey(1)], tokens=[7, 8], offset=512)
    assert tokens_of(d, 1) == [[7, 8]]
    [m] = d.blend_match(query(7, 8), NS)
    assert m.old_st == 512


def test_unknown_chunk_yields_empty_tokens():
    """Ports test_key_directory.py::test_unknown_chunk_yields_empty_tokens (ours: None, not ())."""
    assert KeyDirectory().get_token_ids([bytes([9]) * 4]) == [None]


def test_bindings_are_returned_in_request_order():
    """Ports test_key_directory.py::test_bindings_are_returned_in_request_order."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tokens=[1], offset=0)
    apply_batch(d, [okey(2)], seq=2, tokens=[2], offset=256)
    assert tokens_of(d, 2, 9, 1) == [[2], [], [1]]


def test_restore_replaces_tokens_and_offset():
    """Ports test_key_directory.py::test_restore_replaces_tokens_and_offset."""
    d = blend_directory(2)
    apply_batch(d, [okey(1)], seq=1, tokens=[1, 2], offset=0)
    apply_batch(d, [okey(1)], seq=2, tokens=[3, 4], offset=256)
    assert tokens_of(d, 1) == [[3, 4]]
    [m] = d.blend_match(query(3, 4), NS)
    assert m.old_st == 256
    assert d.blend_match(query(1, 2), NS) == []  # the superseded content is gone


def test_token_ids_outside_uint32_leave_the_binding_unfilled():
    """Ports test_key_directory.py::test_token_ids_outside_uint32_leave_the_binding_unfilled."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tokens=[1, 2**32])
    assert d.lookup([okey(1)])[0]  # the placement applied
    assert tokens_of(d, 1) == [[]]
    apply_batch(d, [okey(1)], seq=2, tokens=[1, 2])  # repaired by the next well-formed entry
    assert tokens_of(d, 1) == [[1, 2]]


def test_negative_token_offset_is_rejected():
    """Ports test_key_directory.py::test_negative_token_offset_is_rejected."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="token_offset"):
        apply_batch(d, [okey(1)], tokens=[1], offset=-2)
    assert d.stats()["num_keys"] == 0


def test_unreported_offset_defaults_to_unknown_not_zero():
    """Ports test_key_directory.py::test_unreported_offset_defaults_to_unknown_not_zero."""
    assert UNKNOWN_TOKEN_OFFSET == -1
    d = blend_directory(2)
    entry = wire_entry(okey(1).chunk_hash, "m", okey(1).kv_rank, token_ids=[1, 2])
    del entry["token_offset"]  # an emitter predating offsets
    d.apply({"batches": [wire_batch("node-a", 1, "store", [entry], incarnation=1)]})
    assert tokens_of(d, 1) == [[1, 2]]
    assert d.blend_match(query(1, 2), NS) == []  # not read as position 0: not indexed at all


def test_restore_with_new_tokens_rebinds():
    """Ports test_key_directory.py::test_restore_with_new_tokens_rebinds."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tokens=[1, 2])
    apply_batch(d, [okey(1)], seq=2, tokens=[3, 4])
    assert tokens_of(d, 1) == [[3, 4]]


def test_fencing_releases_bindings():
    """Ports test_key_directory.py::test_fencing_releases_bindings."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], tokens=[1, 2])
    d.fence_instance("node-a")
    assert tokens_of(d, 1) == [[]]


def test_list_keys_returns_pages_of_matching_keys():
    """Ports test_key_directory.py::test_list_keys_returns_pages_of_matching_keys."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tokens=[1, 2])
    apply_batch(d, [okey(2)], seq=2)
    total, page = _keys(d)
    assert total == 2 and set(page) == {okey(1), okey(2)}
    assert len(page[okey(1)]) == 1


def test_list_keys_filters_keep_matching_placements_only():
    """Ports test_key_directory.py::test_list_keys_filters_keep_matching_placements_only."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1)
    apply_batch(d, [okey(1)], seq=2, tier="l2", backend="fs")
    apply_batch(d, [okey(2)], instance="node-b")
    total, page = _keys(d, tier="l2")
    assert total == 1 and _where(page[okey(1)]) == [("l2", "fs")]
    assert set(_keys(d, instance_id="node-b")[1]) == {okey(2)}
    assert _keys(d, backend="fs")[0] == 1
    assert _keys(d, backend="valkey")[0] == 0


def test_list_keys_paginates_with_stable_total():
    """Ports test_key_directory.py::test_list_keys_paginates_with_stable_total."""
    d = KeyDirectory()
    apply_batch(d, [okey(1), okey(2), okey(3)])
    first_total, first = _keys(d, offset=0, limit=2)
    rest_total, rest = _keys(d, offset=2, limit=2)
    assert first_total == rest_total == 3
    assert (len(first), len(rest)) == (2, 1)
    assert set(first) | set(rest) == {okey(1), okey(2), okey(3)}


def test_list_keys_rejects_negative_paging():
    """Ports test_key_directory.py::test_list_keys_rejects_negative_paging."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="offset"):
        d.key_page(offset=-1)
    with pytest.raises(ValueError, match="limit"):
        d.key_page(limit=-1)


def _invalid_batch(d: KeyDirectory, field: str, value: Any) -> None:
    batch = wire_batch("node-a", 1, "store", entries([okey(1)], 1024, None, 0), incarnation=1)
    batch[field] = value
    d.apply({"batches": [batch]})


def test_tier_all_is_unconstructible():
    """Ports test_key_directory.py::test_tier_all_is_unconstructible."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="tier"):
        _invalid_batch(d, "tier", "all")
    assert d.stats()["num_keys"] == 0


def test_seq_below_one_is_unconstructible():
    """Ports test_key_directory.py::test_seq_below_one_is_unconstructible."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="seq"):
        _invalid_batch(d, "seq", 0)
    assert d.stats()["num_keys"] == 0


def test_negative_size_is_unconstructible():
    """Ports test_key_directory.py::test_negative_size_is_unconstructible."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="size_bytes"):
        apply_batch(d, [okey(1)], size=-1)
    assert d.stats()["num_keys"] == 0


def test_stats_counts_keys_and_placements():
    """Ports test_key_directory.py::test_stats_counts_keys_and_placements."""
    d = KeyDirectory()
    apply_batch(d, [okey(1), okey(2)], instance="node-a")
    apply_batch(d, [okey(1)], instance="node-b", tier="l2", backend="fs")
    stats = d.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (2, 3)
    assert stats["l1_keys_by_instance"]["node-a"] == 2
    # node-b reported only an L2 copy: nothing of it in the L1 (fencing) index
    assert stats["l1_keys_by_instance"].get("node-b", 0) == 0


def test_shared_pool_dedups_across_reporters():
    """Ports test_key_directory.py::test_shared_pool_dedups_across_reporters. Differs:
    a shared placement's ``instance_id`` is ``""`` here (it belongs to no instance;
    docs/lmcache.md), LMCache's names the last reporter."""
    d = KeyDirectory()
    for instance in ("node-a", "node-b"):
        apply_batch(d, [okey(1)], instance=instance, tier="l2", backend="s3", shared=True, size=100)
    [[p]] = d.lookup([okey(1)])
    assert p.shared is True
    assert p.instance_id == SHARED_POOL_INSTANCE == ""


def test_shared_pool_delete_from_any_reporter():
    """Ports test_key_directory.py::test_shared_pool_delete_from_any_reporter."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], instance="node-a", tier="l2", backend="s3", shared=True)
    apply_batch(d, [okey(1)], instance="node-b", kind="delete", tier="l2", backend="s3", shared=True, size=None)
    assert d.lookup([okey(1)]) == [()]


def test_fencing_drops_l1_and_keeps_l2():
    """Ports test_key_directory.py::test_fencing_drops_l1_and_keeps_l2. Differs: fencing
    keeps shared L1 placements (docs/lmcache.md: a shared pool belongs to no process, so
    one reporter restarting does not empty it); LMCache drops the pool controller's."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], instance="pool-controller", backend="cxl", shared=True)
    apply_batch(d, [okey(2)], instance="node-b", seq=1, tier="l2", backend="fs")
    apply_batch(d, [okey(2)], instance="node-b", seq=2, tier="l2", backend="s3", shared=True)
    d.fence_instance("pool-controller")
    d.fence_instance("node-b")
    p1, p2 = d.lookup([okey(1), okey(2)])
    assert [(p.tier, p.backend, p.shared) for p in p1] == [("l1", "cxl", True)]  # ours: kept
    assert sorted(_where(p2)) == [("l2", "fs"), ("l2", "s3")]


def test_fencing_keeps_shared_placement_re_reported_elsewhere():
    """Ports test_key_directory.py::test_fencing_keeps_shared_placement_re_reported_elsewhere.
    Differs only in the placement's ``instance_id`` (``""`` here, see above)."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], instance="node-a", tier="l2", backend="s3", shared=True)
    apply_batch(d, [okey(1)], instance="node-b", tier="l2", backend="s3", shared=True)
    d.fence_instance("node-a")
    [placements] = d.lookup([okey(1)])
    assert [(p.instance_id, p.backend, p.shared) for p in placements] == [("", "s3", True)]


def test_fence_instance_drops_l1_and_keeps_l2():
    """Ports test_key_directory.py::test_fence_instance_drops_l1_and_keeps_l2."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1)
    apply_batch(d, [okey(1)], seq=2, tier="l2", backend="s3", shared=True)
    d.fence_instance("node-a")
    assert [(p.tier, p.shared) for p in d.lookup([okey(1)])[0]] == [("l2", True)]


def test_controller_stream_reports_shared_events():
    """Ports test_key_directory.py::test_controller_stream_reports_shared_events."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], instance="node-a", tier="l2", backend="s3", shared=True)
    apply_batch(d, [okey(1)], instance="pool-controller", kind="delete", tier="l2", backend="s3", shared=True,
        size=None)
    assert d.lookup([okey(1)]) == [()]


def test_empty_instance_id_is_unconstructible():
    """Ports test_key_directory.py::test_empty_instance_id_is_unconstructible."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="instance_id"):
        _invalid_batch(d, "instance_id", "")
    assert d.stats()["num_keys"] == 0


def test_same_backend_private_and_shared_are_distinct_placements():
    """Ports test_key_directory.py::test_same_backend_private_and_shared_are_distinct_placements."""
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, tier="l2", backend="fs")
    apply_batch(d, [okey(1)], seq=2, tier="l2", backend="fs", shared=True)
    assert sorted(p.shared for p in d.lookup([okey(1)])[0]) == [False, True]


# ------------------------------------------------------------------ access counts
# LMCache 0.5.6's KeyDirectory counts the ACCESS entries applied to a key since its creation
# (``record.access_count += 1``, ``views/key_directory.py``) and answers them in
# ``/directory/lookup`` and ``/directory/keys`` (``get_access_counts``: 0 for unknown keys).
def test_access_counts_each_entry_of_an_existing_key():
    d = KeyDirectory()
    apply_batch(d, [okey(1), okey(2)], seq=1, size=100)
    apply_batch(d, [okey(1), okey(1), okey(2), okey(3)], seq=2, kind="access", size=None)
    apply_batch(d, [okey(1)], seq=3, kind="access", size=None)
    assert d.access_counts([okey(1), okey(2), okey(3), okey(1, rank=1)]) == [3, 1, 0, 0]
    # an access to an unknown key created nothing, and storing it later starts at 0
    apply_batch(d, [okey(3)], seq=4, size=100)
    assert d.access_counts([okey(3)]) == [0]


def test_access_count_resets_when_the_key_dies_and_comes_back():
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, size=100)
    apply_batch(d, [okey(1)], seq=1, size=100, instance="node-b")
    apply_batch(d, [okey(1)], seq=2, kind="access", size=None)
    apply_batch(d, [okey(1)], seq=3, kind="delete", size=None)  # node-b's placement still holds the key
    assert d.access_counts([okey(1)]) == [1]
    apply_batch(d, [okey(1)], seq=2, kind="delete", size=None, instance="node-b")  # its last placement
    assert d.access_counts([okey(1)]) == [0]
    apply_batch(d, [okey(1)], seq=4, size=100)
    assert d.access_counts([okey(1)]) == [0]
    apply_batch(d, [okey(1)], seq=5, kind="access", size=None)
    assert d.access_counts([okey(1)]) == [1]


def test_access_count_goes_with_a_key_fenced_away():
    d = KeyDirectory()
    apply_batch(d, [okey(1)], seq=1, size=100)
    apply_batch(d, [okey(1)], seq=2, kind="access", size=None)
    d.fence_instance("node-a")  # its L1 copy, the key's only placement, is gone
    apply_batch(d, [okey(1)], seq=3, size=100)
    assert d.access_counts([okey(1)]) == [0]
