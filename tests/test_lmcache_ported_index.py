"""LMCache's key-directory and blend-index tests, ported to blendmatch: the same behaviour,
asserted in our own words against our public API.

Source: LMCache/LMCache ``tests/v1/mp_coordinator/test_key_directory.py`` and
``test_blend_index.py`` at commit ``08340ea459272bf990c73fa42cb476614a4ee4ad`` (the
closest version of these files we could reach to the 0.5.6 release; the 0.5.6 wheel's
``BlendIndex`` names its ``remove`` ``remove_claim``, otherwise the API the tests use is the
wheel's). One test here per LMCache test, same name; its docstring names the original.

What changed in the port, and only that:

- LMCache feeds ``KeyDirectory.consume(CacheEventBatch(...))`` directly; blendmatch's
  directory takes the ``POST /events`` body (``KeyDirectory.apply``), so each batch goes in
  as wire JSON, through our ingest gate (every test's batches already have fresh
  ``(instance, incarnation, seq)``). A batch LMCache cannot construct (empty backend on a
  store, tier ``all``, ``seq`` 0, ...) is a ``ValueError`` from ``apply`` here, with nothing
  applied.
- ``get_token_ids`` answers ``None`` (ours) where LMCache answers ``()``; ``list_keys`` is
  our ``key_page`` (total + a page of ``KeyPlacements``); ``stats``/``blend_stats`` are dicts
  (``stats()["blend_index"]``). ``BlendIndex.remove(content, hash, ns)`` is our
  ``remove_claim``.
- Where blendmatch deliberately differs (docs/lmcache.md "Deliberate differences"), the
  test is marked ``differs`` in its docstring and asserts our documented behaviour.
"""

from __future__ import annotations

import random
import threading
from typing import Any, Optional

import numpy as np
import pytest

from blendmatch.index import (SHARED_POOL_INSTANCE, UNKNOWN_TOKEN_OFFSET, BlendIndex, BlendLookupDisabled,
                              BlendNamespace, KeyDirectory, ObjectKey, pack_kv_rank, wire_batch, wire_entry)

# ================================================================= key directory (test_key_directory.py)


def _okey(b: int, rank: int = 0, world_size: int = 1, model: str = "m", salt: str = "") -> ObjectKey:
    """A key shaped as a server emits one (``kv_rank`` packs the parallel setup)."""
    return ObjectKey(chunk_hash=bytes([b]) * 4, model_name=model,
                     kv_rank=pack_kv_rank(world_size, rank, world_size, rank), cache_salt=salt)


def _entries(keys: list[ObjectKey], size: Optional[int], tokens: Optional[list[int]], offset: int) -> list[dict]:
    out = []
    for k in keys:
        e = wire_entry(k.chunk_hash, k.model_name, k.kv_rank, cache_salt=k.cache_salt, size_bytes=size or 0,
                       token_ids=tokens or None, token_offset=offset)
        if size is None:
            e.pop("size_bytes")
        out.append(e)
    return out


def _ev(d: KeyDirectory, keys: Optional[list[ObjectKey]] = None, *, instance: str = "node-a", inc: int = 1,
        seq: int = 1, kind: str = "store", tier: str = "l1", backend: str = "dram", size: Optional[int] = 1024,
        shared: bool = False, tokens: Optional[list[int]] = None, offset: int = 0) -> None:
    """Apply one batch (LMCache's ``_batch`` defaults: node-a, incarnation 1, L1 dram, 1 KiB)."""
    entries = _entries(keys if keys is not None else [_okey(0xAA)], size, tokens, offset)
    counts = d.apply({"batches": [wire_batch(instance, seq, kind, entries, incarnation=inc, tier=tier,
                                             backend=backend, shared=shared)]})
    assert counts.applied == 1, counts  # every batch here is fresh at the gate


def _tokens(d: KeyDirectory, *bs: int) -> list[list[int]]:
    """Each chunk's known tokens as a list (``[]``: unknown or not yet carried)."""
    return [[] if t is None else t.tolist() for t in d.get_token_ids([bytes([b]) * 4 for b in bs])]


def _where(placements) -> list[tuple[str, str]]:
    return [(p.tier, p.backend) for p in placements]


def _keys(d: KeyDirectory, **filters: Any) -> tuple[int, dict[ObjectKey, tuple]]:
    page = d.key_page(**filters)
    return page.total, {kp.key: kp.placements for kp in page.keys}


def test_store_then_lookup():
    """Ports test_key_directory.py::test_store_then_lookup."""
    d = KeyDirectory()
    _ev(d, [_okey(1)])
    [[p]] = d.lookup([_okey(1)])
    assert (p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes) == ("node-a", 1, "l1", "dram", 1024)


def test_lookup_unknown_key_is_empty():
    """Ports test_key_directory.py::test_lookup_unknown_key_is_empty."""
    assert KeyDirectory().lookup([_okey(9)]) == [()]


def test_lookup_preserves_request_order():
    """Ports test_key_directory.py::test_lookup_preserves_request_order."""
    d = KeyDirectory()
    _ev(d, [_okey(2)])
    first, second = d.lookup([_okey(1), _okey(2)])
    assert first == () and len(second) == 1


def test_restore_updates_size_without_duplicating_placement():
    """Ports test_key_directory.py::test_restore_updates_size_without_duplicating_placement."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, size=100)
    _ev(d, [_okey(1)], seq=2, size=200)
    [[p]] = d.lookup([_okey(1)])
    assert p.size_bytes == 200


def test_same_key_on_two_instances():
    """Ports test_key_directory.py::test_same_key_on_two_instances."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], instance="node-b")
    _ev(d, [_okey(1)], instance="node-a")
    [placements] = d.lookup([_okey(1)])
    assert [p.instance_id for p in placements] == ["node-a", "node-b"]


def test_same_key_on_two_tiers_of_one_instance():
    """Ports test_key_directory.py::test_same_key_on_two_tiers_of_one_instance."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1)
    _ev(d, [_okey(1)], seq=2, tier="l2", backend="fs")
    assert _where(d.lookup([_okey(1)])[0]) == [("l1", "dram"), ("l2", "fs")]


def test_delete_drops_placement_and_empty_record():
    """Ports test_key_directory.py::test_delete_drops_placement_and_empty_record."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1)
    _ev(d, [_okey(1)], seq=2, kind="delete", size=None)
    assert d.lookup([_okey(1)]) == [()]
    stats = d.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (0, 0)
    assert stats["l1_keys_by_instance"]["node-a"] == 0


def test_removal_of_one_tier_keeps_the_other():
    """Ports test_key_directory.py::test_removal_of_one_tier_keeps_the_other."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1)
    _ev(d, [_okey(1)], seq=2, tier="l2", backend="fs")
    _ev(d, [_okey(1)], seq=3, kind="delete", size=None)
    assert _where(d.lookup([_okey(1)])[0]) == [("l2", "fs")]
    # the L1 count is the fencing index: the key left it although L2 still holds it
    assert d.stats()["l1_keys_by_instance"]["node-a"] == 0


def test_removal_of_unknown_key_is_noop():
    """Ports test_key_directory.py::test_removal_of_unknown_key_is_noop."""
    d = KeyDirectory()
    _ev(d, [_okey(7)], kind="delete", size=None)
    assert d.stats()["num_keys"] == 0


def test_access_does_not_create_records():
    """Ports test_key_directory.py::test_access_does_not_create_records."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], kind="access", size=None)
    assert d.stats()["num_keys"] == 0


def test_access_batch_allows_empty_backend():
    """Ports test_key_directory.py::test_access_batch_allows_empty_backend."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, size=100)
    _ev(d, [_okey(1)], seq=2, kind="access", backend="", size=None)
    [[p]] = d.lookup([_okey(1)])
    assert (p.backend, p.size_bytes) == ("dram", 100)  # the placement is untouched


def test_placement_bearing_batches_require_backend():
    """Ports test_key_directory.py::test_placement_bearing_batches_require_backend."""
    d = KeyDirectory()
    for kind in ("store", "delete"):
        with pytest.raises(ValueError, match="backend"):
            _ev(d, [_okey(1)], kind=kind, backend="")
    assert d.stats()["num_keys"] == 0


def test_fence_instance_removes_all_its_placements():
    """Ports test_key_directory.py::test_fence_instance_removes_all_its_placements."""
    d = KeyDirectory()
    _ev(d, [_okey(1), _okey(2)], instance="node-a")
    _ev(d, [_okey(1)], instance="node-b")
    d.fence_instance("node-a")
    one, two = d.lookup([_okey(1), _okey(2)])
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
    _ev(d, [_okey(1)], seq=1, tokens=[1, 2])
    assert _tokens(d, 1) == [[1, 2]]
    _ev(d, [_okey(1)], seq=2, kind="delete", size=None)
    assert _tokens(d, 1) == [[]]


def test_binding_survives_until_last_record_of_the_chunk():
    """Ports test_key_directory.py::test_binding_survives_until_last_record_of_the_chunk."""
    d = KeyDirectory()
    rank1 = ObjectKey(bytes([1]) * 4, "m", kv_rank=1)
    _ev(d, [_okey(1), rank1], seq=1, tokens=[1, 2])
    _ev(d, [_okey(1)], seq=2, kind="delete", size=None)
    assert _tokens(d, 1) == [[1, 2]]
    _ev(d, [rank1], seq=3, kind="delete", size=None)
    assert _tokens(d, 1) == [[]]


def test_chunks_bind_independently():
    """Ports test_key_directory.py::test_chunks_bind_independently."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, tokens=[1, 2])
    _ev(d, [_okey(2)], seq=2, tokens=[3, 4])
    _ev(d, [_okey(1)], seq=3, kind="delete", size=None)
    assert _tokens(d, 1, 2) == [[], [3, 4]]


def test_token_less_entry_links_empty_binding():
    """Ports test_key_directory.py::test_token_less_entry_links_empty_binding."""
    d = KeyDirectory()
    rank1 = ObjectKey(bytes([1]) * 4, "m", kv_rank=1)
    _ev(d, [rank1], seq=1)
    assert _tokens(d, 1) == [[]]
    _ev(d, [_okey(1)], seq=2, tokens=[1, 2])
    assert _tokens(d, 1) == [[1, 2]]
    _ev(d, [_okey(1)], seq=3, kind="delete", size=None)
    assert _tokens(d, 1) == [[1, 2]]  # the token-less key still holds the chunk


def test_untagged_record_heals_on_restore():
    """Ports test_key_directory.py::test_untagged_record_heals_on_restore."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1)
    assert _tokens(d, 1) == [[]]
    _ev(d, [_okey(1)], seq=2, tokens=[1, 2])
    assert _tokens(d, 1) == [[1, 2]]
    _ev(d, [_okey(1)], seq=3, kind="delete", size=None)
    assert _tokens(d, 1) == [[]]


def _q(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.uint64)


def _blend_directory(chunk: int) -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=chunk, probe_stride=1, engine="cpu")
    return d


NS = BlendNamespace(model_name="m", world_size=1)


def test_binding_records_the_chunks_token_offset():
    """Ports test_key_directory.py::test_binding_records_the_chunks_token_offset."""
    d = _blend_directory(2)
    _ev(d, [_okey(1)], tokens=[7, 8], offset=512)
    assert _tokens(d, 1) == [[7, 8]]
    [m] = d.blend_match(_q(7, 8), NS)
    assert m.old_st == 512


def test_unknown_chunk_yields_empty_tokens():
    """Ports test_key_directory.py::test_unknown_chunk_yields_empty_tokens (ours: None, not ())."""
    assert KeyDirectory().get_token_ids([bytes([9]) * 4]) == [None]


def test_bindings_are_returned_in_request_order():
    """Ports test_key_directory.py::test_bindings_are_returned_in_request_order."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, tokens=[1], offset=0)
    _ev(d, [_okey(2)], seq=2, tokens=[2], offset=256)
    assert _tokens(d, 2, 9, 1) == [[2], [], [1]]


def test_restore_replaces_tokens_and_offset():
    """Ports test_key_directory.py::test_restore_replaces_tokens_and_offset."""
    d = _blend_directory(2)
    _ev(d, [_okey(1)], seq=1, tokens=[1, 2], offset=0)
    _ev(d, [_okey(1)], seq=2, tokens=[3, 4], offset=256)
    assert _tokens(d, 1) == [[3, 4]]
    [m] = d.blend_match(_q(3, 4), NS)
    assert m.old_st == 256
    assert d.blend_match(_q(1, 2), NS) == []  # the superseded content is gone


def test_token_ids_outside_uint32_leave_the_binding_unfilled():
    """Ports test_key_directory.py::test_token_ids_outside_uint32_leave_the_binding_unfilled."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, tokens=[1, 2**32])
    assert d.lookup([_okey(1)])[0]  # the placement applied
    assert _tokens(d, 1) == [[]]
    _ev(d, [_okey(1)], seq=2, tokens=[1, 2])  # repaired by the next well-formed entry
    assert _tokens(d, 1) == [[1, 2]]


def test_negative_token_offset_is_rejected():
    """Ports test_key_directory.py::test_negative_token_offset_is_rejected."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="token_offset"):
        _ev(d, [_okey(1)], tokens=[1], offset=-2)
    assert d.stats()["num_keys"] == 0


def test_unreported_offset_defaults_to_unknown_not_zero():
    """Ports test_key_directory.py::test_unreported_offset_defaults_to_unknown_not_zero."""
    assert UNKNOWN_TOKEN_OFFSET == -1
    d = _blend_directory(2)
    entry = wire_entry(_okey(1).chunk_hash, "m", _okey(1).kv_rank, token_ids=[1, 2])
    del entry["token_offset"]  # an emitter predating offsets
    d.apply({"batches": [wire_batch("node-a", 1, "store", [entry], incarnation=1)]})
    assert _tokens(d, 1) == [[1, 2]]
    assert d.blend_match(_q(1, 2), NS) == []  # not read as position 0: not indexed at all


def test_restore_with_new_tokens_rebinds():
    """Ports test_key_directory.py::test_restore_with_new_tokens_rebinds."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, tokens=[1, 2])
    _ev(d, [_okey(1)], seq=2, tokens=[3, 4])
    assert _tokens(d, 1) == [[3, 4]]


def test_fencing_releases_bindings():
    """Ports test_key_directory.py::test_fencing_releases_bindings."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], tokens=[1, 2])
    d.fence_instance("node-a")
    assert _tokens(d, 1) == [[]]


def test_list_keys_returns_pages_of_matching_keys():
    """Ports test_key_directory.py::test_list_keys_returns_pages_of_matching_keys."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, tokens=[1, 2])
    _ev(d, [_okey(2)], seq=2)
    total, page = _keys(d)
    assert total == 2 and set(page) == {_okey(1), _okey(2)}
    assert len(page[_okey(1)]) == 1


def test_list_keys_filters_keep_matching_placements_only():
    """Ports test_key_directory.py::test_list_keys_filters_keep_matching_placements_only."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1)
    _ev(d, [_okey(1)], seq=2, tier="l2", backend="fs")
    _ev(d, [_okey(2)], instance="node-b")
    total, page = _keys(d, tier="l2")
    assert total == 1 and _where(page[_okey(1)]) == [("l2", "fs")]
    assert set(_keys(d, instance_id="node-b")[1]) == {_okey(2)}
    assert _keys(d, backend="fs")[0] == 1
    assert _keys(d, backend="valkey")[0] == 0


def test_list_keys_paginates_with_stable_total():
    """Ports test_key_directory.py::test_list_keys_paginates_with_stable_total."""
    d = KeyDirectory()
    _ev(d, [_okey(1), _okey(2), _okey(3)])
    first_total, first = _keys(d, offset=0, limit=2)
    rest_total, rest = _keys(d, offset=2, limit=2)
    assert first_total == rest_total == 3
    assert (len(first), len(rest)) == (2, 1)
    assert set(first) | set(rest) == {_okey(1), _okey(2), _okey(3)}


def test_list_keys_rejects_negative_paging():
    """Ports test_key_directory.py::test_list_keys_rejects_negative_paging."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="offset"):
        d.key_page(offset=-1)
    with pytest.raises(ValueError, match="limit"):
        d.key_page(limit=-1)


def _invalid_batch(d: KeyDirectory, field: str, value: Any) -> None:
    batch = wire_batch("node-a", 1, "store", _entries([_okey(1)], 1024, None, 0), incarnation=1)
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
        _ev(d, [_okey(1)], size=-1)
    assert d.stats()["num_keys"] == 0


def test_stats_counts_keys_and_placements():
    """Ports test_key_directory.py::test_stats_counts_keys_and_placements."""
    d = KeyDirectory()
    _ev(d, [_okey(1), _okey(2)], instance="node-a")
    _ev(d, [_okey(1)], instance="node-b", tier="l2", backend="fs")
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
        _ev(d, [_okey(1)], instance=instance, tier="l2", backend="s3", shared=True, size=100)
    [[p]] = d.lookup([_okey(1)])
    assert p.shared is True
    assert p.instance_id == SHARED_POOL_INSTANCE == ""


def test_shared_pool_delete_from_any_reporter():
    """Ports test_key_directory.py::test_shared_pool_delete_from_any_reporter."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], instance="node-a", tier="l2", backend="s3", shared=True)
    _ev(d, [_okey(1)], instance="node-b", kind="delete", tier="l2", backend="s3", shared=True, size=None)
    assert d.lookup([_okey(1)]) == [()]


def test_fencing_drops_l1_and_keeps_l2():
    """Ports test_key_directory.py::test_fencing_drops_l1_and_keeps_l2. Differs: fencing
    keeps shared L1 placements (docs/lmcache.md: a shared pool belongs to no process, so
    one reporter restarting does not empty it); LMCache drops the pool controller's."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], instance="pool-controller", backend="cxl", shared=True)
    _ev(d, [_okey(2)], instance="node-b", seq=1, tier="l2", backend="fs")
    _ev(d, [_okey(2)], instance="node-b", seq=2, tier="l2", backend="s3", shared=True)
    d.fence_instance("pool-controller")
    d.fence_instance("node-b")
    p1, p2 = d.lookup([_okey(1), _okey(2)])
    assert [(p.tier, p.backend, p.shared) for p in p1] == [("l1", "cxl", True)]  # ours: kept
    assert sorted(_where(p2)) == [("l2", "fs"), ("l2", "s3")]


def test_fencing_keeps_shared_placement_re_reported_elsewhere():
    """Ports test_key_directory.py::test_fencing_keeps_shared_placement_re_reported_elsewhere.
    Differs only in the placement's ``instance_id`` (``""`` here, see above)."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], instance="node-a", tier="l2", backend="s3", shared=True)
    _ev(d, [_okey(1)], instance="node-b", tier="l2", backend="s3", shared=True)
    d.fence_instance("node-a")
    [placements] = d.lookup([_okey(1)])
    assert [(p.instance_id, p.backend, p.shared) for p in placements] == [("", "s3", True)]


def test_fence_instance_drops_l1_and_keeps_l2():
    """Ports test_key_directory.py::test_fence_instance_drops_l1_and_keeps_l2."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1)
    _ev(d, [_okey(1)], seq=2, tier="l2", backend="s3", shared=True)
    d.fence_instance("node-a")
    assert [(p.tier, p.shared) for p in d.lookup([_okey(1)])[0]] == [("l2", True)]


def test_controller_stream_reports_shared_events():
    """Ports test_key_directory.py::test_controller_stream_reports_shared_events."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], instance="node-a", tier="l2", backend="s3", shared=True)
    _ev(d, [_okey(1)], instance="pool-controller", kind="delete", tier="l2", backend="s3", shared=True,
        size=None)
    assert d.lookup([_okey(1)]) == [()]


def test_empty_instance_id_is_unconstructible():
    """Ports test_key_directory.py::test_empty_instance_id_is_unconstructible."""
    d = KeyDirectory()
    with pytest.raises(ValueError, match="instance_id"):
        _invalid_batch(d, "instance_id", "")
    assert d.stats()["num_keys"] == 0


def test_same_backend_private_and_shared_are_distinct_placements():
    """Ports test_key_directory.py::test_same_backend_private_and_shared_are_distinct_placements."""
    d = KeyDirectory()
    _ev(d, [_okey(1)], seq=1, tier="l2", backend="fs")
    _ev(d, [_okey(1)], seq=2, tier="l2", backend="fs", shared=True)
    assert sorted(p.shared for p in d.lookup([_okey(1)])[0]) == [False, True]


# ================================================================= blend index (test_blend_index.py)
CHUNK = 4
OTHER_NS = BlendNamespace(model_name="other", world_size=1)


def _c(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.uint32)


def _index(probe_stride: int = 1, chunk: int = CHUNK) -> BlendIndex:
    return BlendIndex(chunk_size=chunk, probe_stride=probe_stride, engine="cpu")


def _t(matches) -> list[tuple[bytes, int, int]]:
    return [(m.chunk_hash, m.old_st, m.cur_st) for m in matches]


def _bstats(index: BlendIndex, *names: str) -> tuple:
    s = index.stats()
    return tuple(s[n] for n in names)


def test_content_is_found_at_its_query_offset():
    """Ports test_blend_index.py::test_content_is_found_at_its_query_offset."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    assert _t(index.match(_q(7, 8, 10, 11, 12, 13, 9), NS)) == [(b"A", 0, 2)]


def test_old_st_is_the_stored_position_not_the_query_position():
    """Ports test_blend_index.py::test_old_st_is_the_stored_position_not_the_query_position."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 1024, NS)
    [m] = index.match(_q(0, 10, 11, 12, 13), NS)
    assert (m.old_st, m.cur_st) == (1024, 1)


def test_several_chunks_are_found_in_one_query_ascending():
    """Ports test_blend_index.py::test_several_chunks_are_found_in_one_query_ascending."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(5, 6, 7, 8), b"B", 4, NS)
    assert _t(index.match(_q(9, 5, 6, 7, 8, 1, 2, 3, 4), NS)) == [(b"B", 4, 1), (b"A", 0, 5)]


def test_repeated_content_matches_once_at_its_first_position():
    """Ports test_blend_index.py::test_repeated_content_matches_once_at_its_first_position."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert _t(index.match(_q(1, 2, 3, 4, 1, 2, 3, 4), NS)) == [(b"A", 0, 0)]


def test_query_shorter_than_the_window_matches_nothing():
    """Ports test_blend_index.py::test_query_shorter_than_the_window_matches_nothing."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert index.match(_q(1, 2, 3), NS) == []


def test_absent_content_matches_nothing():
    """Ports test_blend_index.py::test_absent_content_matches_nothing."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert index.match(_q(5, 6, 7, 8, 9), NS) == []


def test_near_miss_content_is_rejected():
    """Ports test_blend_index.py::test_near_miss_content_is_rejected."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    assert index.match(_q(10, 11, 12, 99), NS) == []


def test_verification_uses_the_indexed_content_not_the_stored_length():
    """Ports test_blend_index.py::test_verification_uses_the_indexed_content_not_the_stored_length."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    [m] = index.match(_q(10, 11, 12, 13, 14), NS)
    assert m.cur_st == 0


def test_add_is_idempotent():
    """Ports test_blend_index.py::test_add_is_idempotent."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert _bstats(index, "num_contents", "num_chunks") == (1, 1)


def test_readding_a_chunk_updates_its_offset():
    """Ports test_blend_index.py::test_readding_a_chunk_updates_its_offset."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(1, 2, 3, 4), b"A", 256, NS)
    [m] = index.match(_q(1, 2, 3, 4), NS)
    assert m.old_st == 256 and _bstats(index, "num_chunks") == (1,)


def test_remove_makes_content_undiscoverable():
    """Ports test_blend_index.py::test_remove_makes_content_undiscoverable."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    assert index.match(_q(1, 2, 3, 4), NS) == []
    assert _bstats(index, "num_contents") == (0,)


def test_remove_of_unknown_chunk_or_content_is_a_noop():
    """Ports test_blend_index.py::test_remove_of_unknown_chunk_or_content_is_a_noop."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert not index.remove_claim(_c(1, 2, 3, 4), b"UNKNOWN", NS)
    assert not index.remove_claim(_c(9, 9, 9, 9), b"A", NS)
    assert _t(index.match(_q(1, 2, 3, 4), NS)) == [(b"A", 0, 0)]


def test_identical_content_under_two_prefixes_survives_one_eviction():
    """Ports test_blend_index.py::test_identical_content_under_two_prefixes_survives_one_eviction."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(1, 2, 3, 4), b"B", 512, NS)
    assert _bstats(index, "num_chunks") == (2,)
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    assert _t(index.match(_q(1, 2, 3, 4), NS)) == [(b"B", 512, 0)]


def test_content_of_the_wrong_length_is_not_indexed():
    """Ports test_blend_index.py::test_content_of_the_wrong_length_is_not_indexed."""
    index = _index()
    index.add(_c(1, 2, 3), b"SHORT", 0, NS)
    index.add(_c(1, 2, 3, 4, 5), b"LONG", 0, NS)
    assert _bstats(index, "num_contents") == (0,)


def test_many_contents_stay_matchable_across_growth_and_compaction():
    """Ports test_blend_index.py::test_many_contents_stay_matchable_across_growth_and_compaction."""
    index = _index()
    contents = {bytes([i]): _c(i, i + 1, i + 2, i + 3) for i in range(1, 200)}
    for h, content in contents.items():
        index.add(content, h, 0, NS)
    for h, content in contents.items():
        assert _t(index.match(content.astype(np.uint64), NS)) == [(h, 0, 0)]
    survivors = {h: c for h, c in contents.items() if h[0] % 20 == 0}
    for h, content in contents.items():
        if h not in survivors:
            index.remove_claim(content, h, NS)
    assert _bstats(index, "num_contents") == (len(survivors),)
    for h, content in survivors.items():
        assert _t(index.match(content.astype(np.uint64), NS)) == [(h, 0, 0)]


def test_stride_skips_offsets_between_probes():
    """Ports test_blend_index.py::test_stride_skips_offsets_between_probes."""
    index = _index(probe_stride=CHUNK)
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    assert index.match(_q(10, 11, 12, 13), NS)  # on a probe position
    assert index.match(_q(0, 10, 11, 12, 13), NS) == []  # one token off: recall traded for CPU


@pytest.mark.parametrize("chunk_size, stride", [(0, 1), (-1, 1), (4, 0), (4, -1)])
def test_invalid_construction_is_rejected(chunk_size: int, stride: int):
    """Ports test_blend_index.py::test_invalid_construction_is_rejected."""
    with pytest.raises(ValueError):
        BlendIndex(chunk_size=chunk_size, probe_stride=stride, engine="cpu")


def test_matches_a_brute_force_scan_on_random_input():
    """Ports test_blend_index.py::test_matches_a_brute_force_scan_on_random_input."""
    rng = random.Random(1234)
    chunk = 8
    index = _index(chunk=chunk)
    stored: dict[bytes, tuple[list[int], int]] = {}
    for i in range(60):
        tokens = [rng.randrange(1, 5000) for _ in range(chunk)]
        if any(tokens == t for t, _ in stored.values()):
            continue
        stored[f"c{i}".encode()] = (tokens, i * chunk)
        index.add(_c(*tokens), f"c{i}".encode(), i * chunk, NS)
    for _ in range(20):
        query: list[int] = []
        for _ in range(12):
            if rng.random() < 0.5:
                query += rng.choice(list(stored.values()))[0]
            else:
                query += [rng.randrange(1, 5000) for _ in range(chunk)]
        expected, seen = [], set()
        for start in range(len(query) - chunk + 1):  # each content's first occurrence
            for h, (tokens, offset) in stored.items():
                if h not in seen and query[start:start + chunk] == tokens:
                    seen.add(h)
                    expected.append((h, offset, start))
        assert _t(index.match(_q(*query), NS)) == expected


def test_concurrent_add_and_match_stay_consistent():
    """Ports test_blend_index.py::test_concurrent_add_and_match_stay_consistent."""
    index = _index()
    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(1, 400):
                index.add(_c(i, i + 1, i + 2, i + 3), bytes([i % 256]), i, NS)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                index.match(_q(5, 6, 7, 8), NS)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert index.match(_q(5, 6, 7, 8), NS)


# -- key directory integration


def _store(d: KeyDirectory, keys: list[ObjectKey], tokens: list[int], seq: int, offset: int = 0,
           kind: str = "store") -> None:
    """LMCache's ``_store``: node-a, incarnation 1, L1 dram, 100 bytes per entry."""
    _ev(d, keys, seq=seq, kind=kind, size=100, tokens=tokens, offset=offset)


def _h(b: int) -> bytes:
    return bytes([b]) * 4


def _blend_count(d: KeyDirectory, name: str) -> int:
    return d.stats()["blend_index"][name]


def test_a_stored_chunk_becomes_fragment_matchable():
    """Ports test_blend_index.py::test_a_stored_chunk_becomes_fragment_matchable."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1, offset=256)
    assert _t(d.blend_match(_q(0, 10, 11, 12, 13), NS)) == [(_h(1), 256, 1)]


def test_deleting_the_last_placement_removes_it_from_fragment_matching():
    """Ports test_blend_index.py::test_deleting_the_last_placement_removes_it_from_fragment_matching."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1)
    _store(d, [_okey(1)], [], seq=2, kind="delete")
    assert d.blend_match(_q(10, 11, 12, 13), NS) == []
    assert _blend_count(d, "num_contents") == 0


def test_chunk_stays_matchable_while_any_rank_holds_it():
    """Ports test_blend_index.py::test_chunk_stays_matchable_while_any_rank_holds_it."""
    d = _blend_directory(CHUNK)
    ns2 = BlendNamespace(model_name="m", world_size=2)
    rank0, rank1 = _okey(1, rank=0, world_size=2), _okey(1, rank=1, world_size=2)
    _store(d, [rank0, rank1], [10, 11, 12, 13], seq=1)
    _store(d, [rank0], [], seq=2, kind="delete")
    assert _t(d.blend_match(_q(10, 11, 12, 13), ns2)) == [(_h(1), 0, 0)]
    _store(d, [rank1], [], seq=3, kind="delete")
    assert d.blend_match(_q(10, 11, 12, 13), ns2) == []


def test_restoring_a_chunk_with_new_content_retires_the_old_fingerprint():
    """Ports test_blend_index.py::test_restoring_a_chunk_with_new_content_retires_the_old_fingerprint."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1)
    _store(d, [_okey(1)], [20, 21, 22, 23], seq=2)
    assert d.blend_match(_q(10, 11, 12, 13), NS) == []
    assert _t(d.blend_match(_q(20, 21, 22, 23), NS)) == [(_h(1), 0, 0)]
    assert _blend_count(d, "num_contents") == 1


def test_a_tokenless_store_is_not_fragment_matchable():
    """Ports test_blend_index.py::test_a_tokenless_store_is_not_fragment_matchable."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [], seq=1)
    assert _blend_count(d, "num_contents") == 0
    assert d.blend_match(_q(10, 11, 12, 13), NS) == []


def test_incarnation_fencing_removes_fragment_matches():
    """Ports test_blend_index.py::test_incarnation_fencing_removes_fragment_matches."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1)
    d.fence_instance("node-a")
    assert d.blend_match(_q(10, 11, 12, 13), NS) == []


def test_chunk_with_unreported_offset_is_not_fragment_matchable():
    """Ports test_blend_index.py::test_chunk_with_unreported_offset_is_not_fragment_matchable."""
    d = _blend_directory(CHUNK)
    entry = wire_entry(_h(1), "m", _okey(1).kv_rank, size_bytes=100, token_ids=[10, 11, 12, 13])
    del entry["token_offset"]  # unreported -> unknown
    d.apply({"batches": [wire_batch("node-a", 1, "store", [entry], incarnation=1, backend="dram")]})
    assert _tokens(d, 1) == [[10, 11, 12, 13]]  # the content is known ...
    assert _blend_count(d, "num_chunks") == 0  # ... but without a position it is not indexed
    assert d.blend_match(_q(10, 11, 12, 13), NS) == []


def test_a_later_offset_bearing_store_makes_the_chunk_matchable():
    """Ports test_blend_index.py::test_a_later_offset_bearing_store_makes_the_chunk_matchable."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1, offset=-1)
    assert _blend_count(d, "num_chunks") == 0
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=2, offset=256)
    assert _t(d.blend_match(_q(10, 11, 12, 13), NS)) == [(_h(1), 256, 0)]


def test_blend_lookup_is_off_until_enabled():
    """Ports test_blend_index.py::test_blend_lookup_is_off_until_enabled. Differs: a blend
    lookup on a directory that never enabled it raises ``BlendLookupDisabled`` here (the
    service answers it as an error, not as an empty match list); LMCache returns ``[]``."""
    d = KeyDirectory()
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1)
    assert d.blend_index is None and d.stats()["blend_index"] is None  # nothing indexed
    with pytest.raises(BlendLookupDisabled):
        d.blend_match(_q(10, 11, 12, 13), NS)
    assert _tokens(d, 1) == [[10, 11, 12, 13]]  # the binding is still recorded


def test_enabling_does_not_retroactively_index_earlier_stores():
    """Ports test_blend_index.py::test_enabling_does_not_retroactively_index_earlier_stores."""
    d = KeyDirectory()
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1)
    d.enable_blend_lookup(chunk_size=CHUNK, probe_stride=1, engine="cpu")
    assert d.blend_match(_q(10, 11, 12, 13), NS) == []
    _store(d, [_okey(2)], [20, 21, 22, 23], seq=2)
    assert d.blend_match(_q(20, 21, 22, 23), NS)


# -- namespace scoping


def test_content_stored_by_another_namespace_is_not_offered():
    """Ports test_blend_index.py::test_content_stored_by_another_namespace_is_not_offered."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, OTHER_NS)
    assert index.match(_q(1, 2, 3, 4), NS) == []
    assert _t(index.match(_q(1, 2, 3, 4), OTHER_NS)) == [(b"A", 0, 0)]


def test_the_requester_s_own_chunk_is_found_behind_another_namespace_s():
    """Ports test_blend_index.py::test_the_requester_s_own_chunk_is_found_behind_another_namespace_s."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"THEIRS", 0, OTHER_NS)
    index.add(_c(1, 2, 3, 4), b"MINE", 512, NS)
    assert _t(index.match(_q(1, 2, 3, 4), NS)) == [(b"MINE", 512, 0)]


def _two_claims() -> BlendIndex:
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(1, 2, 3, 4), b"A", 0, OTHER_NS)
    return index


def test_one_chunk_shared_by_two_namespaces_serves_both():
    """Ports test_blend_index.py::test_one_chunk_shared_by_two_namespaces_serves_both."""
    index = _two_claims()
    assert _t(index.match(_q(1, 2, 3, 4), NS)) == _t(index.match(_q(1, 2, 3, 4), OTHER_NS)) == [(b"A", 0, 0)]
    assert _bstats(index, "num_chunks", "num_claims", "num_namespaces") == (1, 2, 2)


def test_releasing_one_namespace_leaves_the_other_matching():
    """Ports test_blend_index.py::test_releasing_one_namespace_leaves_the_other_matching."""
    index = _two_claims()
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    assert index.match(_q(1, 2, 3, 4), NS) == []
    assert _t(index.match(_q(1, 2, 3, 4), OTHER_NS)) == [(b"A", 0, 0)]
    assert _bstats(index, "num_contents") == (1,)


def test_releasing_the_last_namespace_drops_the_content():
    """Ports test_blend_index.py::test_releasing_the_last_namespace_drops_the_content."""
    index = _two_claims()
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    index.remove_claim(_c(1, 2, 3, 4), b"A", OTHER_NS)
    assert index.match(_q(1, 2, 3, 4), OTHER_NS) == []
    assert _bstats(index, "num_contents") == (0,)


def test_remove_chunk_retires_every_namespace_at_once():
    """Ports test_blend_index.py::test_remove_chunk_retires_every_namespace_at_once."""
    index = _two_claims()
    index.remove_chunk(_c(1, 2, 3, 4), b"A")
    assert index.match(_q(1, 2, 3, 4), NS) == index.match(_q(1, 2, 3, 4), OTHER_NS) == []
    assert _bstats(index, "num_contents") == (0,)


@pytest.mark.parametrize("requester", [BlendNamespace("other", "", 1), BlendNamespace("m", "tenant-b", 1),
                                       BlendNamespace("m", "", 2)],
                         ids=["other-model", "other-salt", "other-world-size"])
def test_directory_does_not_offer_matches_across_namespaces(requester: BlendNamespace):
    """Ports test_blend_index.py::test_directory_does_not_offer_matches_across_namespaces."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1)], [10, 11, 12, 13], seq=1)
    assert d.blend_match(_q(10, 11, 12, 13), requester) == []
    assert _t(d.blend_match(_q(10, 11, 12, 13), NS)) == [(_h(1), 0, 0)]


def _salt_ns(salt: str) -> BlendNamespace:
    return BlendNamespace(model_name="m", cache_salt=salt, world_size=1)


def test_directory_offers_a_chunk_two_tenants_stored_to_each_of_them():
    """Ports test_blend_index.py::test_directory_offers_a_chunk_two_tenants_stored_to_each_of_them."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1, salt="a"), _okey(1, salt="b")], [10, 11, 12, 13], seq=1)
    for salt in ("a", "b"):
        assert _t(d.blend_match(_q(10, 11, 12, 13), _salt_ns(salt))) == [(_h(1), 0, 0)]
    assert _blend_count(d, "num_claims") == 2


def test_directory_releases_a_namespace_claim_when_its_last_key_goes():
    """Ports test_blend_index.py::test_directory_releases_a_namespace_claim_when_its_last_key_goes."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1, salt="a"), _okey(1, salt="b")], [10, 11, 12, 13], seq=1)
    _store(d, [_okey(1, salt="a")], [], seq=2, kind="delete")
    assert d.blend_match(_q(10, 11, 12, 13), _salt_ns("a")) == []
    assert _t(d.blend_match(_q(10, 11, 12, 13), _salt_ns("b"))) == [(_h(1), 0, 0)]


def test_a_namespace_joining_a_bound_chunk_without_tokens_still_claims_it():
    """Ports test_blend_index.py::test_a_namespace_joining_a_bound_chunk_without_tokens_still_claims_it."""
    d = _blend_directory(CHUNK)
    _store(d, [_okey(1, salt="a")], [10, 11, 12, 13], seq=1)
    _store(d, [_okey(1, salt="b")], [], seq=2)
    assert _t(d.blend_match(_q(10, 11, 12, 13), _salt_ns("b"))) == [(_h(1), 0, 0)]
