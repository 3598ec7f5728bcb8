"""LMCache 0.5.6's blend-index tests (``tests/v1/mp_coordinator/test_blend_index.py`` at
LMCache commit ``08340ea459272bf990c73fa42cb476614a4ee4ad``), ported: one test per LMCache
test, same name. How they are ported, and the differences they assert: ``lmcache_port_support``.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from blendmatch.index import (BlendIndex, BlendLookupDisabled, BlendNamespace, KeyDirectory, ObjectKey, wire_batch,
                              wire_entry)

from blendmatch.service.app import create_app
from blendmatch.service.config import ServiceConfig

from lmcache_port_support import NS, apply_batch, as_tuples, blend_directory, okey, query, tokens_of

CHUNK = 4
OTHER_NS = BlendNamespace(model_name="other", world_size=1)


def _c(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.uint32)


def _index(probe_stride: int = 1, chunk: int = CHUNK) -> BlendIndex:
    return BlendIndex(chunk_size=chunk, probe_stride=probe_stride, engine="cpu")


def _bstats(index: BlendIndex, *names: str) -> tuple:
    s = index.stats()
    return tuple(s[n] for n in names)


def test_content_is_found_at_its_query_offset():
    """Ports test_blend_index.py::test_content_is_found_at_its_query_offset."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    assert as_tuples(index.match(query(7, 8, 10, 11, 12, 13, 9), NS)) == [(b"A", 0, 2)]


def test_old_st_is_the_stored_position_not_the_query_position():
    """Ports test_blend_index.py::test_old_st_is_the_stored_position_not_the_query_position."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 1024, NS)
    [m] = index.match(query(0, 10, 11, 12, 13), NS)
    assert (m.old_st, m.cur_st) == (1024, 1)


def test_several_chunks_are_found_in_one_query_ascending():
    """Ports test_blend_index.py::test_several_chunks_are_found_in_one_query_ascending."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(5, 6, 7, 8), b"B", 4, NS)
    assert as_tuples(index.match(query(9, 5, 6, 7, 8, 1, 2, 3, 4), NS)) == [(b"B", 4, 1), (b"A", 0, 5)]


def test_repeated_content_matches_once_at_its_first_position():
    """Ports test_blend_index.py::test_repeated_content_matches_once_at_its_first_position."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert as_tuples(index.match(query(1, 2, 3, 4, 1, 2, 3, 4), NS)) == [(b"A", 0, 0)]


def test_query_shorter_than_the_window_matches_nothing():
    """Ports test_blend_index.py::test_query_shorter_than_the_window_matches_nothing."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert index.match(query(1, 2, 3), NS) == []


def test_absent_content_matches_nothing():
    """Ports test_blend_index.py::test_absent_content_matches_nothing."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert index.match(query(5, 6, 7, 8, 9), NS) == []


def test_near_miss_content_is_rejected():
    """Ports test_blend_index.py::test_near_miss_content_is_rejected."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    assert index.match(query(10, 11, 12, 99), NS) == []


def test_verification_uses_the_indexed_content_not_the_stored_length():
    """Ports test_blend_index.py::test_verification_uses_the_indexed_content_not_the_stored_length."""
    index = _index()
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    [m] = index.match(query(10, 11, 12, 13, 14), NS)
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
    [m] = index.match(query(1, 2, 3, 4), NS)
    assert m.old_st == 256 and _bstats(index, "num_chunks") == (1,)


def test_remove_makes_content_undiscoverable():
    """Ports test_blend_index.py::test_remove_makes_content_undiscoverable."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    assert index.match(query(1, 2, 3, 4), NS) == []
    assert _bstats(index, "num_contents") == (0,)


def test_remove_of_unknown_chunk_or_content_is_a_noop():
    """Ports test_blend_index.py::test_remove_of_unknown_chunk_or_content_is_a_noop."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    assert not index.remove_claim(_c(1, 2, 3, 4), b"UNKNOWN", NS)
    assert not index.remove_claim(_c(9, 9, 9, 9), b"A", NS)
    assert as_tuples(index.match(query(1, 2, 3, 4), NS)) == [(b"A", 0, 0)]


def test_identical_content_under_two_prefixes_survives_one_eviction():
    """Ports test_blend_index.py::test_identical_content_under_two_prefixes_survives_one_eviction."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(1, 2, 3, 4), b"B", 512, NS)
    assert _bstats(index, "num_chunks") == (2,)
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    assert as_tuples(index.match(query(1, 2, 3, 4), NS)) == [(b"B", 512, 0)]


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
        assert as_tuples(index.match(content.astype(np.uint64), NS)) == [(h, 0, 0)]
    survivors = {h: c for h, c in contents.items() if h[0] % 20 == 0}
    for h, content in contents.items():
        if h not in survivors:
            index.remove_claim(content, h, NS)
    assert _bstats(index, "num_contents") == (len(survivors),)
    for h, content in survivors.items():
        assert as_tuples(index.match(content.astype(np.uint64), NS)) == [(h, 0, 0)]


def test_stride_skips_offsets_between_probes():
    """Ports test_blend_index.py::test_stride_skips_offsets_between_probes."""
    index = _index(probe_stride=CHUNK)
    index.add(_c(10, 11, 12, 13), b"A", 0, NS)
    assert index.match(query(10, 11, 12, 13), NS)  # on a probe position
    assert index.match(query(0, 10, 11, 12, 13), NS) == []  # one token off: recall traded for CPU


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
        q: list[int] = []
        for _ in range(12):
            if rng.random() < 0.5:
                q += rng.choice(list(stored.values()))[0]
            else:
                q += [rng.randrange(1, 5000) for _ in range(chunk)]
        expected, seen = [], set()
        for start in range(len(q) - chunk + 1):  # each content's first occurrence
            for h, (tokens, offset) in stored.items():
                if h not in seen and q[start:start + chunk] == tokens:
                    seen.add(h)
                    expected.append((h, offset, start))
        assert as_tuples(index.match(query(*q), NS)) == expected


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
                index.match(query(5, 6, 7, 8), NS)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert index.match(query(5, 6, 7, 8), NS)


# -- key directory integration


def _store(d: KeyDirectory, keys: list[ObjectKey], tokens: list[int], seq: int, offset: int = 0,
           kind: str = "store") -> None:
    """LMCache's ``_store``: node-a, incarnation 1, L1 dram, 100 bytes per entry."""
    apply_batch(d, keys, seq=seq, kind=kind, size=100, tokens=tokens, offset=offset)


def _h(b: int) -> bytes:
    return bytes([b]) * 4


def _blend_count(d: KeyDirectory, name: str) -> int:
    return d.stats()["blend_index"][name]


def test_a_stored_chunk_becomes_fragment_matchable():
    """Ports test_blend_index.py::test_a_stored_chunk_becomes_fragment_matchable."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1, offset=256)
    assert as_tuples(d.blend_match(query(0, 10, 11, 12, 13), NS)) == [(_h(1), 256, 1)]


def test_deleting_the_last_placement_removes_it_from_fragment_matching():
    """Ports test_blend_index.py::test_deleting_the_last_placement_removes_it_from_fragment_matching."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1)
    _store(d, [okey(1)], [], seq=2, kind="delete")
    assert d.blend_match(query(10, 11, 12, 13), NS) == []
    assert _blend_count(d, "num_contents") == 0


def test_chunk_stays_matchable_while_any_rank_holds_it():
    """Ports test_blend_index.py::test_chunk_stays_matchable_while_any_rank_holds_it."""
    d = blend_directory(CHUNK)
    ns2 = BlendNamespace(model_name="m", world_size=2)
    rank0, rank1 = okey(1, rank=0, world_size=2), okey(1, rank=1, world_size=2)
    _store(d, [rank0, rank1], [10, 11, 12, 13], seq=1)
    _store(d, [rank0], [], seq=2, kind="delete")
    assert as_tuples(d.blend_match(query(10, 11, 12, 13), ns2)) == [(_h(1), 0, 0)]
    _store(d, [rank1], [], seq=3, kind="delete")
    assert d.blend_match(query(10, 11, 12, 13), ns2) == []


def test_restoring_a_chunk_with_new_content_retires_the_old_fingerprint():
    """Ports test_blend_index.py::test_restoring_a_chunk_with_new_content_retires_the_old_fingerprint."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1)
    _store(d, [okey(1)], [20, 21, 22, 23], seq=2)
    assert d.blend_match(query(10, 11, 12, 13), NS) == []
    assert as_tuples(d.blend_match(query(20, 21, 22, 23), NS)) == [(_h(1), 0, 0)]
    assert _blend_count(d, "num_contents") == 1


def test_a_tokenless_store_is_not_fragment_matchable():
    """Ports test_blend_index.py::test_a_tokenless_store_is_not_fragment_matchable."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [], seq=1)
    assert _blend_count(d, "num_contents") == 0
    assert d.blend_match(query(10, 11, 12, 13), NS) == []


def test_incarnation_fencing_removes_fragment_matches():
    """Ports test_blend_index.py::test_incarnation_fencing_removes_fragment_matches."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1)
    d.fence_instance("node-a")
    assert d.blend_match(query(10, 11, 12, 13), NS) == []


def test_chunk_with_unreported_offset_is_not_fragment_matchable():
    """Ports test_blend_index.py::test_chunk_with_unreported_offset_is_not_fragment_matchable."""
    d = blend_directory(CHUNK)
    entry = wire_entry(_h(1), "m", okey(1).kv_rank, size_bytes=100, token_ids=[10, 11, 12, 13])
    del entry["token_offset"]  # unreported -> unknown
    d.apply({"batches": [wire_batch("node-a", 1, "store", [entry], incarnation=1, backend="dram")]})
    assert tokens_of(d, 1) == [[10, 11, 12, 13]]  # the content is known ...
    assert _blend_count(d, "num_chunks") == 0  # ... but without a position it is not indexed
    assert d.blend_match(query(10, 11, 12, 13), NS) == []


def test_a_later_offset_bearing_store_makes_the_chunk_matchable():
    """Ports test_blend_index.py::test_a_later_offset_bearing_store_makes_the_chunk_matchable."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1, offset=-1)
    assert _blend_count(d, "num_chunks") == 0
    _store(d, [okey(1)], [10, 11, 12, 13], seq=2, offset=256)
    assert as_tuples(d.blend_match(query(10, 11, 12, 13), NS)) == [(_h(1), 256, 0)]


def test_blend_lookup_is_off_until_enabled():
    """Ports test_blend_index.py::test_blend_lookup_is_off_until_enabled. Differs in-process
    only: ``KeyDirectory.blend_match`` on a directory that never enabled blend lookup raises
    ``BlendLookupDisabled`` (LMCache's returns ``[]``); over HTTP the answer is LMCache's."""
    d = KeyDirectory()
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1)
    assert d.blend_index is None and d.stats()["blend_index"] is None  # nothing indexed
    with pytest.raises(BlendLookupDisabled):
        d.blend_match(query(10, 11, 12, 13), NS)
    assert tokens_of(d, 1) == [[10, 11, 12, 13]]  # the binding is still recorded

    config = ServiceConfig(host="127.0.0.1", engine="cpu", health_check_interval=0, chunk_size=CHUNK,
                           enable_blend_lookup=False)
    with TestClient(create_app(config), client=("127.0.0.1", 50000)) as client:
        entry = wire_entry(okey(1).chunk_hash, "m", okey(1).kv_rank, size_bytes=100, token_ids=[10, 11, 12, 13],
                           token_offset=0)
        assert client.post("/events", json={"batches": [wire_batch("node-a", 1, "store", [entry],
                                                                   incarnation=1, backend="dram")]}).status_code == 200
        resp = client.post("/directory/blend-lookup", json={"token_ids": [10, 11, 12, 13], "model_name": "m"})
        assert (resp.status_code, resp.json()) == (200, {"matches": []})


def test_enabling_does_not_retroactively_index_earlier_stores():
    """Ports test_blend_index.py::test_enabling_does_not_retroactively_index_earlier_stores."""
    d = KeyDirectory()
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1)
    d.enable_blend_lookup(chunk_size=CHUNK, probe_stride=1, engine="cpu")
    assert d.blend_match(query(10, 11, 12, 13), NS) == []
    _store(d, [okey(2)], [20, 21, 22, 23], seq=2)
    assert d.blend_match(query(20, 21, 22, 23), NS)


# -- namespace scoping


def test_content_stored_by_another_namespace_is_not_offered():
    """Ports test_blend_index.py::test_content_stored_by_another_namespace_is_not_offered."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, OTHER_NS)
    assert index.match(query(1, 2, 3, 4), NS) == []
    assert as_tuples(index.match(query(1, 2, 3, 4), OTHER_NS)) == [(b"A", 0, 0)]


def test_the_requester_s_own_chunk_is_found_behind_another_namespace_s():
    """Ports test_blend_index.py::test_the_requester_s_own_chunk_is_found_behind_another_namespace_s."""
    index = _index()
    index.add(_c(1, 2, 3, 4), b"THEIRS", 0, OTHER_NS)
    index.add(_c(1, 2, 3, 4), b"MINE", 512, NS)
    assert as_tuples(index.match(query(1, 2, 3, 4), NS)) == [(b"MINE", 512, 0)]


def _two_claims() -> BlendIndex:
    index = _index()
    index.add(_c(1, 2, 3, 4), b"A", 0, NS)
    index.add(_c(1, 2, 3, 4), b"A", 0, OTHER_NS)
    return index


def test_one_chunk_shared_by_two_namespaces_serves_both():
    """Ports test_blend_index.py::test_one_chunk_shared_by_two_namespaces_serves_both."""
    index = _two_claims()
    for ns in (NS, OTHER_NS):
        assert as_tuples(index.match(query(1, 2, 3, 4), ns)) == [(b"A", 0, 0)]
    assert _bstats(index, "num_chunks", "num_claims", "num_namespaces") == (1, 2, 2)


def test_releasing_one_namespace_leaves_the_other_matching():
    """Ports test_blend_index.py::test_releasing_one_namespace_leaves_the_other_matching."""
    index = _two_claims()
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    assert index.match(query(1, 2, 3, 4), NS) == []
    assert as_tuples(index.match(query(1, 2, 3, 4), OTHER_NS)) == [(b"A", 0, 0)]
    assert _bstats(index, "num_contents") == (1,)


def test_releasing_the_last_namespace_drops_the_content():
    """Ports test_blend_index.py::test_releasing_the_last_namespace_drops_the_content."""
    index = _two_claims()
    index.remove_claim(_c(1, 2, 3, 4), b"A", NS)
    index.remove_claim(_c(1, 2, 3, 4), b"A", OTHER_NS)
    assert index.match(query(1, 2, 3, 4), OTHER_NS) == []
    assert _bstats(index, "num_contents") == (0,)


def test_remove_chunk_retires_every_namespace_at_once():
    """Ports test_blend_index.py::test_remove_chunk_retires_every_namespace_at_once."""
    index = _two_claims()
    index.remove_chunk(_c(1, 2, 3, 4), b"A")
    assert index.match(query(1, 2, 3, 4), NS) == index.match(query(1, 2, 3, 4), OTHER_NS) == []
    assert _bstats(index, "num_contents") == (0,)


@pytest.mark.parametrize("requester", [BlendNamespace("other", "", 1), BlendNamespace("m", "tenant-b", 1),
                                       BlendNamespace("m", "", 2)],
                         ids=["other-model", "other-salt", "other-world-size"])
def test_directory_does_not_offer_matches_across_namespaces(requester: BlendNamespace):
    """Ports test_blend_index.py::test_directory_does_not_offer_matches_across_namespaces."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1)], [10, 11, 12, 13], seq=1)
    assert d.blend_match(query(10, 11, 12, 13), requester) == []
    assert as_tuples(d.blend_match(query(10, 11, 12, 13), NS)) == [(_h(1), 0, 0)]


def _salt_ns(salt: str) -> BlendNamespace:
    return BlendNamespace(model_name="m", cache_salt=salt, world_size=1)


def test_directory_offers_a_chunk_two_tenants_stored_to_each_of_them():
    """Ports test_blend_index.py::test_directory_offers_a_chunk_two_tenants_stored_to_each_of_them."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1, salt="a"), okey(1, salt="b")], [10, 11, 12, 13], seq=1)
    for salt in ("a", "b"):
        assert as_tuples(d.blend_match(query(10, 11, 12, 13), _salt_ns(salt))) == [(_h(1), 0, 0)]
    assert _blend_count(d, "num_claims") == 2


def test_directory_releases_a_namespace_claim_when_its_last_key_goes():
    """Ports test_blend_index.py::test_directory_releases_a_namespace_claim_when_its_last_key_goes."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1, salt="a"), okey(1, salt="b")], [10, 11, 12, 13], seq=1)
    _store(d, [okey(1, salt="a")], [], seq=2, kind="delete")
    assert d.blend_match(query(10, 11, 12, 13), _salt_ns("a")) == []
    assert as_tuples(d.blend_match(query(10, 11, 12, 13), _salt_ns("b"))) == [(_h(1), 0, 0)]


def test_a_namespace_joining_a_bound_chunk_without_tokens_still_claims_it():
    """Ports test_blend_index.py::test_a_namespace_joining_a_bound_chunk_without_tokens_still_claims_it."""
    d = blend_directory(CHUNK)
    _store(d, [okey(1, salt="a")], [10, 11, 12, 13], seq=1)
    _store(d, [okey(1, salt="b")], [], seq=2)
    assert as_tuples(d.blend_match(query(10, 11, 12, 13), _salt_ns("b"))) == [(_h(1), 0, 0)]
