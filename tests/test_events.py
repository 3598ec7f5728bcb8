"""Cache events: the wire shape, validation errors that name the field, and the gate."""

from __future__ import annotations

import base64
import copy
import json

import numpy as np
import pydantic
import pytest

from blendmatch.index.gate import Admission, IngestGate, InstanceCursor
from blendmatch.index.wire import (
    MAX_CACHE_SALT_CHARS,
    EventRequest,
    EventValidationError,
    KeyScope,
    parse_event_batch,
    parse_event_request,
)
from blendmatch.index.wire_models import EventBatchModel, EventRequestModel, wire_batch, wire_entry
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import BlendNamespace, ObjectKey, pack_kv_rank


def _entry(**over) -> dict:
    entry = {"key": {"chunk_hash_hex": "00ff", "model_name": "m", "kv_rank": pack_kv_rank(2, 1)},
             "size_bytes": 10}
    for path, value in over.items():
        target = entry
        *parents, leaf = path.split("__")
        for p in parents:
            target = target[p]
        if value is _DROP:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    return entry


def _batch(entries=(), **over) -> dict:
    """A valid store batch (one entry unless ``entries`` is given), then ``over`` applied."""
    batch = {"instance_id": "a", "incarnation": 0, "seq": 1, "event_type": "store", "tier": "l1",
             "backend": "cpu", "entries": [_entry()] if entries == () else entries}
    if entries is _DROP:
        del batch["entries"]
    for k, v in over.items():
        if v is _DROP:
            batch.pop(k, None)
        else:
            batch[k] = v
    return batch


_DROP = object()


# ----------------------------------------------------------------------------- valid input


def test_minimal_request_and_defaults():
    req = parse_event_request({"batches": [_batch()]})
    assert isinstance(req, EventRequest) and len(req.batches) == 1
    b = req.batches[0]
    assert (b.instance_id, b.incarnation, b.seq, b.event_type, b.tier, b.backend) == ("a", 0, 1, "store", "l1", "cpu")
    assert b.shared is False and b.ts == 0.0 and b.capacity_bytes == 0 and b.capacity_revision == 0
    (h, scope, size, offset), = b.entries.items
    assert h == b"\x00\xff" and size == 10 and offset == -1
    assert scope == KeyScope("m", pack_kv_rank(2, 1), 0, "", BlendNamespace("m", "", 2))
    assert b.entries.keys() == [ObjectKey(b"\x00\xff", "m", pack_kv_rank(2, 1))]
    assert b.entries.tokens.row(0) is None
    assert req.num_entries == 1


def test_hex_either_case_and_scopes_are_interned():
    entries = [_entry(key__chunk_hash_hex="ABcd"), _entry(key__chunk_hash_hex="abcd")]
    req = parse_event_request({"batches": [_batch(entries)]})
    (h1, s1, _, _), (h2, s2, _, _) = req.batches[0].entries.items
    assert h1 == h2 == b"\xab\xcd"
    assert s1 is s2


def test_tokens_are_converted_in_bulk():
    entries = [_entry(token_ids=[1, 2, 3], token_offset=0), _entry(), _entry(token_ids=[4, 5, 6])]
    col = parse_event_request({"batches": [_batch(entries)]}).batches[0].entries.tokens
    assert col.row(0).tolist() == [1, 2, 3] and col.row(1) is None and col.row(2).tolist() == [4, 5, 6]
    assert col.row(0).dtype == np.uint32 and not col.row(0).flags.writeable
    assert col.rows([0, 2]).tolist() == [[1, 2, 3], [4, 5, 6]]
    uniform = parse_event_request({"batches": [_batch([_entry(token_ids=[1, 2]), _entry(token_ids=[3, 4])])]})
    assert uniform.batches[0].entries.tokens.rows([1, 0]).tolist() == [[3, 4], [1, 2]]


@pytest.mark.parametrize("tokens", [[1, -1], [2**32], [2**70, 1]])
def test_token_ids_outside_uint32_are_valid_but_unfilled(tokens):
    req = parse_event_request({"batches": [_batch([_entry(token_ids=[7]), _entry(token_ids=tokens)])]})
    col = req.batches[0].entries.tokens
    assert col.unfilled == [1] and col.row(1) is None and col.row(0).tolist() == [7]


def _packed_variants(rows: list[list[int]]) -> dict[str, list]:
    """The same token rows as lists, uint32 arrays, int64 arrays, views of one buffer,
    strided arrays and little-endian bytes."""
    flat = np.array([t for r in rows for t in r], dtype=np.uint32)
    starts = np.cumsum([0] + [len(r) for r in rows]).tolist()
    return {
        "lists": rows,
        "uint32": [np.array(r, dtype=np.uint32) for r in rows],
        "int64": [np.array(r, dtype=np.int64) for r in rows],
        "views": [flat[a:b] for a, b in zip(starts, starts[1:])],
        "strided": [np.repeat(np.array(r, dtype=np.uint32), 2)[::2] for r in rows],
        "bytes": [np.array(r, dtype="<u4").tobytes() for r in rows],
    }


@pytest.mark.parametrize("form", ["lists", "uint32", "int64", "views", "strided", "bytes"])
@pytest.mark.parametrize("rows", [[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [], [2**32 - 1]]])
def test_packed_token_ids_parse_like_lists(form, rows):
    """In-process producers may pass numpy arrays or little-endian uint32 bytes: the batch
    is judged and converted exactly as the same ids sent as JSON lists, and copied."""
    given = _packed_variants(rows)[form]
    col = parse_event_request({"batches": [_batch([_entry(token_ids=t, token_offset=0) for t in given])]}
                              ).batches[0].entries.tokens
    assert [None if col.row(i) is None else col.row(i).tolist() for i in range(len(rows))] == \
        [r or None for r in rows]
    assert col.lengths == [len(r) for r in rows] and col.unfilled == []
    assert col.flat.dtype == np.uint32 and not col.flat.flags.writeable
    if form in ("uint32", "int64", "views"):  # the batch holds a copy: the producer may reuse its arrays
        for t in given:
            t[...] = 0
        assert col.row(0).tolist() == rows[0]


@pytest.mark.parametrize("form", ["uint32", "int64", "bytes"])
def test_packed_token_ids_mixed_with_lists_in_one_batch(form):
    packed = _packed_variants([[4, 5]])[form][0]
    col = parse_event_request({"batches": [_batch([_entry(token_ids=[1, 2, 3]), _entry(token_ids=packed),
                                                   _entry()])]}).batches[0].entries.tokens
    assert col.row(0).tolist() == [1, 2, 3] and col.row(1).tolist() == [4, 5] and col.row(2) is None


@pytest.mark.parametrize("tokens", [np.array([1, -1], dtype=np.int64), np.array([2**32], dtype=np.uint64),
                                    np.array([2**40, 1], dtype=np.int64)])
@pytest.mark.parametrize("alone", [True, False])
def test_packed_token_ids_outside_uint32_are_valid_but_unfilled(tokens, alone):
    others = [np.array([7], dtype=tokens.dtype)] if alone else [[7]]
    req = parse_event_request({"batches": [_batch([_entry(token_ids=others[0]), _entry(token_ids=tokens)])]})
    col = req.batches[0].entries.tokens
    assert col.unfilled == [1] and col.row(1) is None and col.row(0).tolist() == [7]


@pytest.mark.parametrize("tokens", [np.array([[1, 2]], dtype=np.uint32), np.array([1.0, 2.0]),
                                    np.array([True, False]), np.array(["1"]), b"\x01\x00\x00",
                                    bytearray(b"\x01\x00"), np.uint32(3)])
@pytest.mark.parametrize("alone", [True, False])
def test_bad_packed_token_ids_are_named(tokens, alone):
    entries = [_entry(token_ids=tokens), _entry(token_ids=tokens)] if alone else \
        [_entry(token_ids=[1]), _entry(token_ids=tokens)]
    with pytest.raises(EventValidationError) as err:
        parse_event_request({"batches": [_batch(entries)]})
    assert err.value.field.startswith("batches[0].entries[") and ".token_ids" in err.value.field


def _b64(tokens) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode()


@pytest.mark.parametrize("rows", [[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [], [2**32 - 1]]])
@pytest.mark.parametrize("extra", [{}, {"token_ids": []}])
def test_tokens_b64_parse_like_token_ids(rows, extra):
    """``tokens_b64`` (strict base64 of LE uint32) is the same column as the ids as lists,
    also with an empty ``token_ids`` beside it; "" and null mean no tokens."""
    col = parse_event_request({"batches": [_batch([_entry(tokens_b64=_b64(r), **extra) for r in rows])]}
                              ).batches[0].entries.tokens
    want = parse_event_request({"batches": [_batch([_entry(token_ids=r) for r in rows])]}).batches[0].entries.tokens
    assert col.lengths == want.lengths == [len(r) for r in rows] and col.unfilled == []
    assert col.flat.tolist() == want.flat.tolist()
    assert col.flat.dtype == np.uint32 and not col.flat.flags.writeable
    for tokens_b64 in ("", None):
        none = parse_event_request({"batches": [_batch([_entry(tokens_b64=tokens_b64), _entry(tokens_b64="")])]})
        assert none.batches[0].entries.tokens.lengths == [0, 0]


def test_tokens_b64_mixed_with_token_ids_in_one_batch():
    entries = [_entry(token_ids=[1, 2, 3]), _entry(tokens_b64=_b64([4, 5])), _entry(),
               _entry(tokens_b64="", token_ids=[6]), _entry(tokens_b64=None, token_ids=[7]),
               _entry(tokens_b64=_b64([8]), token_ids=[])]
    col = parse_event_request({"batches": [_batch(entries)]}).batches[0].entries.tokens
    assert [None if col.row(i) is None else col.row(i).tolist() for i in range(len(entries))] == \
        [[1, 2, 3], [4, 5], None, [6], [7], [8]]


@pytest.mark.parametrize("extra", [{}, {"token_ids": []}])
def test_tokens_b64_batch_takes_the_fast_path(monkeypatch, extra):
    """A batch whose entries all use tokens_b64 never goes entry by entry."""
    from blendmatch.index import wire_entries as events

    entries = [_entry(key__chunk_hash_hex=f"{i:04x}", tokens_b64=_b64([i, i + 1]), **extra) for i in range(3)]
    parse_event_request({"batches": [_batch(entries)]})  # first-seen scope: may go slow once

    def boom(raw):
        raise AssertionError("slow path taken")

    monkeypatch.setattr(events, "_parse_entries_slow", boom)
    col = parse_event_request({"batches": [_batch(entries)]}).batches[0].entries.tokens
    assert col.rows(range(3)).tolist() == [[0, 1], [1, 2], [2, 3]]


@pytest.mark.parametrize("form", ["token_ids", "tokens_b64", "mixed"])
def test_tokens_b64_directory_matches_equal_token_ids(form):
    """Through a KeyDirectory, tokens_b64 binds and indexes exactly as token_ids."""
    c = 8
    rows = np.random.default_rng(3).integers(0, 50_000, size=(6, c), dtype=np.uint32)
    query = np.concatenate([np.full(5, 60_000, dtype=np.uint32), rows[4], rows[1], rows[1][:3], rows[5]])

    def entry(i: int) -> dict:
        e = _entry(key__chunk_hash_hex=bytes([0xab, i]).hex(), token_offset=i * c)
        use_b64 = form == "tokens_b64" or (form == "mixed" and i % 2)
        e["tokens_b64" if use_b64 else "token_ids"] = _b64(rows[i]) if use_b64 else rows[i].tolist()
        return e

    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=c, probe_stride=1, engine="reference")
    counts = d.apply({"batches": [_batch([entry(i) for i in range(6)])]})
    assert counts.applied == 1
    matches = [(m.chunk_hash, m.old_st, m.cur_st) for m in d.blend_match(query, BlendNamespace("m", "", 2))]
    assert matches == [(bytes([0xab, 4]), 4 * c, 5), (bytes([0xab, 1]), c, 5 + c), (bytes([0xab, 5]), 5 * c, 5 + 2 * c + 3)]
    assert [t.tolist() for t in d.get_token_ids([bytes([0xab, 2])])] == [rows[2].tolist()]


@pytest.mark.parametrize("alone", [True, False])
@pytest.mark.parametrize("over, reason", [
    (dict(tokens_b64="AQAAAA==", token_ids=[1]), "give token_ids or tokens_b64, not both"),
    (dict(tokens_b64="AQAAAA==", token_ids=np.array([1], dtype=np.uint32)), "not both"),
    (dict(tokens_b64="AQAA AA="), "not valid standard base64"),
    (dict(tokens_b64="AQAAAA=="[:-1]), "not valid standard base64"),
    (dict(tokens_b64="AQAAAA-_"), "not valid standard base64"),
    (dict(tokens_b64="=AQAAAA="), "not valid standard base64"),
    (dict(tokens_b64="AQAAAA==\n"), "not valid standard base64"),
    (dict(tokens_b64="\u00e9AAA"), "not valid standard base64"),
    (dict(tokens_b64="AQAA"), "decoded byte length 3 is not a multiple of 4"),
    (dict(tokens_b64="AQAAAAI="), "decoded byte length 5 is not a multiple of 4"),
    (dict(tokens_b64=5), "must be a base64 string, got int"),
    (dict(tokens_b64=["AQAAAA=="]), "must be a base64 string, got list"),
    (dict(tokens_b64=b"AQAAAA=="), "must be a base64 string, got bytes"),
])
def test_bad_tokens_b64_is_named(over, reason, alone):
    """Whether every entry of the batch uses tokens_b64 (the fast path) or not."""
    good = _entry(tokens_b64=_b64([9])) if alone else _entry(token_ids=[9])
    with pytest.raises(EventValidationError) as err:
        parse_event_request({"batches": [_batch([good, _entry(**over)])]})
    assert err.value.field == "batches[0].entries[1].tokens_b64"
    assert reason in err.value.reason
    assert str(err.value).startswith("batches[0].entries[1].tokens_b64: ")


def test_config_batch_and_access_without_backend():
    req = parse_event_request({"batches": [
        _batch(entries=_DROP, event_type="config", capacity_bytes=5, capacity_revision=1),
        _batch([], event_type="access", backend=_DROP, seq=2),
    ]})
    assert req.batches[0].capacity_bytes == 5 and len(req.batches[0].entries) == 0
    assert req.batches[1].backend == ""


def test_capacity_fields_are_accepted_on_every_batch_type():
    """LMCache 0.5.6's serializer writes capacity_bytes=0, capacity_revision=0 on every batch."""
    req = parse_event_request({"batches": [
        _batch(capacity_bytes=0, capacity_revision=0),
        _batch([], event_type="delete", seq=2, capacity_bytes=7, capacity_revision=3),
        _batch([], event_type="access", backend="", seq=3, capacity_bytes=0, capacity_revision=0),
    ]})
    assert [b.capacity_bytes for b in req.batches] == [0, 7, 0]
    assert [b.capacity_revision for b in req.batches] == [0, 3, 0]


def test_size_bytes_is_optional_and_defaults_to_zero():
    entry = _entry()
    del entry["size_bytes"]
    for kind in ("store", "delete", "access"):
        b = parse_event_request({"batches": [_batch([entry, _entry()], event_type=kind,
                                                    backend="" if kind == "access" else "cpu")]}).batches[0]
        assert b.entries.sizes == [0, 10]


def test_unknown_fields_are_ignored_for_forward_compatibility():
    batch = _batch([_entry(extra=1, key__future="x")], newer_field=[1, 2])
    assert len(parse_event_request({"batches": [batch], "meta": {}}).batches[0].entries) == 1


def test_parsed_input_passes_through():
    req = parse_event_request({"batches": [_batch()]})
    assert parse_event_request(req) is req
    assert parse_event_batch(req.batches[0]) is req.batches[0]


def test_wire_helpers_round_trip():
    batch = wire_batch("i", 3, "store", [wire_entry(b"\x01\x02", "m", token_ids=np.arange(4), token_offset=8,
                                                    cache_salt="s", object_group_id=2, size_bytes=7)],
                       tier="l2", backend="disk", shared=True, ts=1.5)
    b = parse_event_request(json.loads(json.dumps({"batches": [batch]}))).batches[0]
    assert (b.seq, b.tier, b.backend, b.shared, b.ts) == (3, "l2", "disk", True, 1.5)
    assert b.entries.keys() == [ObjectKey(b"\x01\x02", "m", 1 << 24, 2, "s")]
    assert b.entries.tokens.row(0).tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- invalid input

BAD_BATCHES = [
    # (overrides on the batch, field path)
    (dict(instance_id=""), "instance_id"),
    (dict(instance_id=_DROP), "instance_id"),
    (dict(instance_id=5), "instance_id"),
    (dict(incarnation=-1), "incarnation"),
    (dict(incarnation=_DROP), "incarnation"),
    (dict(incarnation=True), "incarnation"),
    (dict(seq=0), "seq"),
    (dict(seq=1.5), "seq"),
    (dict(seq=True), "seq"),
    (dict(seq="1"), "seq"),
    (dict(event_type="evict"), "event_type"),
    (dict(event_type="STORE"), "event_type"),
    (dict(tier="all"), "tier"),
    (dict(tier="l3"), "tier"),
    (dict(tier="L1"), "tier"),
    (dict(tier=_DROP), "tier"),
    (dict(backend=""), "backend"),
    (dict(backend=_DROP), "backend"),
    (dict(backend=None), "backend"),
    (dict(shared="yes"), "shared"),
    (dict(ts=-1), "ts"),
    (dict(ts="now"), "ts"),
    (dict(ts=float("inf")), "ts"),
    (dict(capacity_bytes=-1), "capacity_bytes"),
    (dict(capacity_revision=-1), "capacity_revision"),
    (dict(capacity_bytes=1.5), "capacity_bytes"),
    (dict(capacity_bytes=-1.0), "capacity_bytes"),
    (dict(event_type="config", capacity_bytes=-1, entries=[]), "capacity_bytes"),
    (dict(event_type="config"), "entries"),
    (dict(entries={}), "entries"),
    (dict(entries=None), "entries"),
]

BAD_ENTRIES = [
    # (overrides on the entry, field path below entries[1])
    (dict(key=_DROP), "key"),
    (dict(key="00ff"), "key"),
    (dict(key__chunk_hash_hex=_DROP), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex=""), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex="abc"), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex="zz"), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex="ab cd"), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex="0x00"), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex="ab" * 129), "key.chunk_hash_hex"),
    (dict(key__chunk_hash_hex=12), "key.chunk_hash_hex"),
    (dict(key__model_name=_DROP), "key.model_name"),
    (dict(key__model_name=""), "key.model_name"),
    (dict(key__model_name="llama@8b"), "key.model_name"),
    (dict(key__model_name=7), "key.model_name"),
    (dict(key__kv_rank=_DROP), "key.kv_rank"),
    (dict(key__kv_rank=-1), "key.kv_rank"),
    (dict(key__kv_rank=2**32), "key.kv_rank"),
    (dict(key__kv_rank=True), "key.kv_rank"),
    (dict(key__kv_rank=1.5), "key.kv_rank"),
    (dict(key__kv_rank=float("inf")), "key.kv_rank"),
    (dict(key__object_group_id=-1), "key.object_group_id"),
    (dict(key__object_group_id="0"), "key.object_group_id"),
    (dict(key__cache_salt="a@b"), "key.cache_salt"),
    (dict(key__cache_salt="a/b"), "key.cache_salt"),
    (dict(key__cache_salt="a\\b"), "key.cache_salt"),
    (dict(key__cache_salt="a\x00b"), "key.cache_salt"),
    (dict(key__cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1)), "key.cache_salt"),
    (dict(key__cache_salt=None), "key.cache_salt"),
    (dict(size_bytes=-1), "size_bytes"),
    (dict(size_bytes=1.5), "size_bytes"),
    (dict(token_offset=-2), "token_offset"),
    (dict(token_offset="0"), "token_offset"),
    (dict(token_offset=2**63), "token_offset"),
    (dict(token_ids="1,2"), "token_ids"),
    (dict(token_ids=None), "token_ids"),
    (dict(token_ids=[1, 2.5]), "token_ids[1]"),
    (dict(token_ids=[1, "2"]), "token_ids[1]"),
    (dict(token_ids=[None]), "token_ids[0]"),
    (dict(token_ids=[[1]]), "token_ids[0]"),
    (dict(tokens_b64="AQAAAA==", token_ids=[1]), "tokens_b64"),
    (dict(tokens_b64="AQAA AA="), "tokens_b64"),
    (dict(tokens_b64="AQAAAA="), "tokens_b64"),
    (dict(tokens_b64="AQAAAA-_"), "tokens_b64"),
    (dict(tokens_b64="AQAA"), "tokens_b64"),
    (dict(tokens_b64=5), "tokens_b64"),
    (dict(tokens_b64=[1]), "tokens_b64"),
    (dict(tokens_b64="AQAAAA==", token_ids=None), "token_ids"),
]


@pytest.mark.parametrize("over, field", BAD_BATCHES)
def test_bad_batch_field_is_named(over, field):
    with pytest.raises(EventValidationError) as err:
        parse_event_request({"batches": [_batch(), _batch(**over)]})
    assert err.value.field == f"batches[1].{field}"
    assert err.value.loc[:2] == ("batches", 1)
    assert str(err.value).startswith(f"batches[1].{field}: ")
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("over, field", BAD_ENTRIES)
def test_bad_entry_field_is_named(over, field):
    with pytest.raises(EventValidationError) as err:
        parse_event_request({"batches": [_batch([_entry(), _entry(**over)])]})
    assert err.value.field == f"batches[0].entries[1].{field}"


@pytest.mark.parametrize("payload, field", [
    ([], ""), ({}, "batches"), ({"batches": {}}, "batches"), ({"batches": [3]}, "batches[0]"),
    ({"batches": [_batch(entries=[5])]}, "batches[0].entries[0]"),
])
def test_bad_request_shape(payload, field):
    with pytest.raises(EventValidationError) as err:
        parse_event_request(payload)
    assert err.value.field == field


def test_parse_event_batch_prefixes_its_location():
    with pytest.raises(EventValidationError) as err:
        parse_event_batch(_batch(seq=0), loc=("partition", 3))
    assert err.value.field == "partition[3].seq"


def test_validation_does_not_depend_on_what_was_seen_before():
    """The fast path caches validated key scopes; a bad value must still be caught after a
    good one with an equal hash (True == 1); 1.0 is the integer 1 (as in LMCache)."""
    good = _entry(key__kv_rank=1)
    parse_event_request({"batches": [_batch([good])]})
    with pytest.raises(EventValidationError, match="kv_rank"):
        parse_event_request({"batches": [_batch([good, _entry(key__kv_rank=True)])]})
    req = parse_event_request({"batches": [_batch([good, _entry(key__kv_rank=1.0)])]})
    assert [type(scope.kv_rank) for scope in req.batches[0].entries.scopes] == [int, int]


def test_integral_floats_are_integers_as_in_lmcache():
    """LMCache's pydantic models read ``870926.0`` as 870926; so does the parser (and the
    schema models). Fractional floats, strings and booleans stay refused (BAD_BATCHES)."""
    entry = _entry(key__kv_rank=float(pack_kv_rank(2, 1)), key__object_group_id=1.0, size_bytes=10.0,
                   token_offset=-1.0, token_ids=[1.0, 2, 3e0])
    raw = {"batches": [_batch([entry], seq=870926.0, incarnation=2.0, capacity_bytes=0.0, capacity_revision=-0.0)]}
    batch = parse_event_request(raw).batches[0]
    assert (batch.seq, batch.incarnation, batch.capacity_bytes, batch.capacity_revision) == (870926, 2, 0, 0)
    assert all(type(v) is int for v in (batch.seq, batch.incarnation, batch.capacity_bytes, batch.capacity_revision))
    entries = batch.entries
    (scope,), (size,), (offset,) = entries.scopes, entries.sizes, entries.offsets
    assert (scope.kv_rank, scope.object_group_id, size, offset) == (pack_kv_rank(2, 1), 1, 10, -1)
    assert batch.entries.tokens.row(0).tolist() == [1, 2, 3]
    EventRequestModel.model_validate(raw)  # the schema models agree


# ----------------------------------------------------------------------------- schema agreement


def _corpus() -> list[tuple[dict, bool]]:
    """Requests the fast validator and the pydantic models must judge alike."""
    out: list[tuple[dict, bool]] = [({"batches": [_batch()]}, True),
                                    ({"batches": [_batch([_entry(token_ids=[1, 2**40], token_offset=3)])]}, True),
                                    ({"batches": [_batch(entries=[], event_type="access", backend="")]}, True),
                                    ({"batches": [_batch([_entry(tokens_b64="AQAAAAIAAAA=", token_offset=0),
                                                          _entry(tokens_b64="")])]}, True),
                                    ({"batches": [_batch([_entry(tokens_b64="AQAAAA==", token_ids=[]),
                                                          _entry(tokens_b64=None, token_ids=[1]),
                                                          _entry(tokens_b64="", token_ids=[2])])]}, True),
                                    ({"batches": []}, True)]
    for over, _ in BAD_BATCHES:
        out.append(({"batches": [_batch(**over)]}, False))
    for over, _ in BAD_ENTRIES:
        out.append(({"batches": [_batch([_entry(**over)])]}, False))
    return out


@pytest.mark.parametrize("payload, valid", _corpus())
def test_fast_validator_agrees_with_the_schema_models(payload, valid):
    payload = copy.deepcopy(payload)
    try:
        parse_event_request(payload)
        fast_ok = True
    except EventValidationError:
        fast_ok = False
    try:
        EventRequestModel.model_validate(payload)
        model_ok = True
    except pydantic.ValidationError:
        model_ok = False
    assert fast_ok is valid
    assert model_ok is valid


def test_schema_models_publish_a_json_schema():
    schema = EventRequestModel.model_json_schema()
    assert "batches" in schema["properties"]
    assert EventBatchModel.model_json_schema()["properties"]["tier"]["enum"] == ["l1", "l2"]


# ----------------------------------------------------------------------------- gate


def test_gate_orders_batches_per_instance():
    g = IngestGate()
    assert g.admit("a", 0, 1) is Admission.APPLY
    assert g.admit("a", 0, 2) is Admission.APPLY
    assert g.admit("a", 0, 2) is Admission.DUPLICATE
    assert g.admit("a", 0, 1) is Admission.DUPLICATE
    assert g.admit("b", 0, 1) is Admission.APPLY  # instances are independent
    assert g.cursor("a") == InstanceCursor(0, 2)
    assert g.counters() == {"applied": 3, "duplicates": 2, "stale": 0, "gaps": 0, "missed": 0, "fences": 0}


def test_gate_incarnations():
    g = IngestGate()
    g.admit("a", 1, 10)
    assert g.admit("a", 0, 99) is Admission.STALE
    assert g.admit("a", 2, 1) is Admission.FENCE_AND_APPLY
    assert g.cursor("a") == InstanceCursor(2, 1)
    assert g.admit("a", 1, 11) is Admission.STALE
    assert g.admit("a", 2, 1) is Admission.DUPLICATE
    assert g.counters()["stale"] == 2 and g.counters()["fences"] == 1


def test_gate_admits_and_counts_gaps():
    g = IngestGate()
    g.admit("a", 0, 1)
    assert g.admit("a", 0, 4) is Admission.APPLY
    assert g.admit("a", 0, 3) is Admission.DUPLICATE  # arrived after its successor
    assert g.counters()["gaps"] == 1 and g.counters()["missed"] == 2
    assert g.admit("a", 1, 3) is Admission.FENCE_AND_APPLY  # a restart that skipped 1..2
    assert g.counters()["gaps"] == 2 and g.counters()["missed"] == 4
    assert g.cursors() == {"a": InstanceCursor(1, 3)}
