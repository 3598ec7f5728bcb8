"""The entries pass (``index/wire_scan.py``): the columns it builds from a body's bytes are
exactly what the JSON parser and the entry parser build, and every body it does not take
is parsed as before, with the same answer or the same error.

The oracle is the ordinary path: ``pydantic_core.from_json`` of the whole body and
``parse_event_request`` (no split of any kind), and the token-split path it replaced.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from blendmatch.index import wire, wire_scan
from blendmatch.index.tokens import split_token_arrays
from blendmatch.index.wire import EventRequest, parse_event_body, parse_event_request


def _entry(i: int, *, tokens: int = 256, model: str = "m-1", salt: str = "", rank: int = 16777216,
           offset: int = 0, size: int = 1024, hash_bytes: int = 16) -> dict:
    rng = np.random.default_rng(i)
    return {"key": {"chunk_hash_hex": (i + 1).to_bytes(hash_bytes, "big").hex(), "model_name": model,
                    "kv_rank": rank, "object_group_id": 0, "cache_salt": salt},
            "size_bytes": size, "token_offset": offset,
            "token_ids": rng.integers(0, 150_000, tokens).tolist()}


def _body(*batches: list[dict], event_type: str = "store", **batch_fields) -> bytes:
    return json.dumps({"batches": [
        {"instance_id": f"i-{k}", "incarnation": 0, "seq": k + 1, "event_type": event_type, "tier": "l1",
         "backend": "LocalCPUBackend", "entries": entries, **batch_fields}
        for k, entries in enumerate(batches)]}).encode()


def _answer(fn, raw: bytes):
    try:
        return _flatten(fn(raw))
    except ValueError as exc:  # EventValidationError and JSON errors
        return (type(exc).__name__, str(exc))


def _flatten(req: EventRequest) -> list:
    out = []
    for b in req.batches:
        e = b.entries
        t = e.tokens
        out.append((b.instance_id, b.incarnation, b.seq, b.event_type, b.tier, b.backend, b.shared, b.ts,
                    b.capacity_bytes, b.capacity_revision, list(e.chunk_hashes), [id(s) for s in e.scopes],
                    list(e.sizes), list(e.offsets), list(t.lengths), list(t.unfilled),
                    [t.row(i).tolist() if t.row(i) is not None else None for i in range(len(e))]))
    return out


def _whole(raw: bytes) -> EventRequest:
    return parse_event_request(from_json(raw))


def _token_split(raw: bytes) -> EventRequest:
    return parse_event_body(raw, arrays=split_token_arrays(raw))


def _same_as_oracle(raw: bytes) -> None:
    got = _answer(parse_event_body, raw)
    assert got == _answer(_whole, raw)
    assert got == _answer(_token_split, raw)


# ---------------------------------------------------------------------- the norm is taken


def test_lmcache_store_bodies_are_taken_and_give_the_same_columns():
    raw = _body([_entry(i) for i in range(64)], [_entry(100 + i, model="m-2", salt="t") for i in range(3)])
    split = wire_scan.split_entries(raw)
    assert split is not None  # the pass took it: no per-entry JSON objects
    assert b"token_ids" not in split.text and len(split.text) < 400
    cols = wire_scan.entry_columns(split)
    assert [len(c) for c in cols] == [64, 3]
    assert cols[1].scopes[0].namespace.model_name == "m-2" and cols[1].scopes[0].cache_salt == "t"
    _same_as_oracle(raw)


def test_any_field_order_whitespace_defaults_and_mixed_scopes_are_taken():
    entries = []
    for i in range(12):
        e = _entry(i, tokens=3 + i % 4, model=f"m-{i % 3}", salt="" if i % 2 else "s", rank=i % 5,
                   offset=-1 if i % 4 == 0 else 256 * i, hash_bytes=8 + i % 3)
        if i % 3 == 0:
            del e["size_bytes"], e["key"]["object_group_id"], e["key"]["cache_salt"], e["token_offset"]
        if i % 5 == 0:
            e = dict(reversed(list(e.items())))
        if i == 7:
            del e["token_ids"]
        if i == 8:
            e["token_ids"] = []
        entries.append(e)
    raw = json.dumps({"batches": [
        {"entries": entries, "instance_id": "a", "incarnation": 2, "seq": 5, "event_type": "store", "tier": "l2",
         "backend": "Disk", "shared": True, "ts": 1.5},
        {"instance_id": "a", "incarnation": 2, "seq": 6, "event_type": "config", "tier": "l1", "backend": "x",
         "entries": [], "capacity_bytes": 10, "capacity_revision": 1},
        {"instance_id": "a", "incarnation": 2, "seq": 7, "event_type": "delete", "tier": "l1", "backend": "x",
         "entries": [{"key": e["key"]} for e in entries[:3]]},
    ]}, indent=1).encode()
    assert wire_scan.split_entries(raw) is not None
    _same_as_oracle(raw)


@pytest.mark.parametrize("mutate", [
    lambda s: s.replace('"model_name": "m-1"', '"model_name": "m\\u002d1"', 1),  # an escape
    lambda s: s.replace('"size_bytes": 1024', '"size_bytes": 1024, "extra": {"entries": [1]}', 1),  # unknown field
    lambda s: s.replace('"size_bytes": 1024', '"size_bytes": 1024, "size_bytes": 7', 1),  # repeated
    lambda s: s.replace('"token_offset": 0', '"token_offset": 0.0', 1),  # integral float (LMCache: an int)
    lambda s: s.replace('"token_offset": 0', '"token_offset": null', 1),
    lambda s: s.replace('"token_offset": 0', '"token_offset": -2', 1),
    lambda s: s.replace('"size_bytes": 1024', '"size_bytes": -1', 1),
    lambda s: s.replace('"kv_rank": 16777216', '"kv_rank": 4294967296', 1),
    lambda s: s.replace('"token_ids": [', '"token_ids": [4294967296, ', 1),  # unfilled, not an error
    lambda s: s.replace('"token_ids": [', '"token_ids": [1.5, ', 1),
    lambda s: s.replace('"token_ids": [', '"token_ids": [01, ', 1),
    lambda s: s.replace('"token_ids": [', '"tokens_b64": "AQAAAA==", "token_ids": [', 1),
    lambda s: s.replace('"model_name": "m-1"', '"model_name": "m@1"', 1),  # the interner refuses it
    lambda s: s.replace('"model_name": "m-1"', '"model_name": ""', 1),
    lambda s: s.replace('"cache_salt": ""', '"cache_salt": "a/b"', 1),
    lambda s: s.replace('"chunk_hash_hex": "', '"chunk_hash_hex": "zz', 1),
    lambda s: s.replace('"chunk_hash_hex": "', '"chunk_hash_hex": "0', 1),  # odd length
    lambda s: s.replace('"kv_rank": 16777216, ', '', 1),  # required
    lambda s: s.replace('"entries": [', '"entries": [7, ', 1),
    lambda s: s.replace('"entries": [', '"entries": {"a": [', 1),  # not JSON any more
    lambda s: s.replace('"event_type": "store"', '"event_type": "config"', 1),  # config with entries
    lambda s: s.replace('"seq": 1', '"seq": 0', 1),  # a batch field error, entries fine
    lambda s: s.replace('"token_ids": [', '"token_ids": [ ', 1).replace("]}", "] }", 1),
    lambda s: s.replace('"model_name": "m-1"', '"model_name": "m\u00e9-1"', 1),  # UTF-8, taken
    lambda s: s[:-3],  # truncated
    lambda s: s.replace('"token_offset": 0', '"token_offsets": 5', 1),  # unknown, a known name's extension
    lambda s: s.replace('"object_group_id": 0', '"object_group": 3', 1),
])
def test_a_body_the_pass_does_not_take_or_that_is_bad_gets_the_ordinary_answer(mutate):
    raw = mutate(_body([_entry(i) for i in range(12)]).decode()).encode()
    _same_as_oracle(raw)


def test_what_the_pass_gives_up_on():
    base = _body([_entry(i) for i in range(12)]).decode()
    assert wire_scan.split_entries(base.encode()) is not None
    for bad in ('"token_offset": 0.0', '"token_offset": null', '"token_offset": -2', '"token_offset": 0, "x": 1'):
        assert wire_scan.split_entries(base.replace('"token_offset": 0', bad, 1).encode()) is None, bad
    assert wire_scan.split_entries(base.replace('"token_ids": [', '"token_ids": [4294967296, ', 1).encode()) is None
    assert wire_scan.split_entries(base.replace('"m-1"', '"m\\n1"', 1).encode()) is None
    assert wire_scan.split_entries(b'{"batches": []}') is None  # short: not worth a pass


# ---------------------------------------------------------------------- property: any body


_names = st.sampled_from(["m", "llama-3", "m\u00e9", "a@b", "", "x" * 3])
_salts = st.sampled_from(["", "t1", "a/b", "s" * 129])
_ints = st.one_of(st.integers(-3, 3), st.integers(0, 2**64), st.just(4294967295), st.just(4294967296),
                  st.just((1 << 63) - 1), st.just(1 << 63), st.floats(allow_nan=False, allow_infinity=False),
                  st.none(), st.booleans(), st.just("5"))


@st.composite
def _entries(draw):
    n = draw(st.integers(0, 20))
    out = []
    for i in range(n):
        key = {"chunk_hash_hex": draw(st.sampled_from([(i + 1).to_bytes(16, "big").hex(), "abcd", "0" * 3, "AB" * 8,
                                                       (i % 3).to_bytes(4, "big").hex()])),
               "model_name": draw(_names), "kv_rank": draw(st.one_of(st.integers(0, 2**32 - 1), _ints))}
        if draw(st.booleans()):
            key["object_group_id"] = draw(st.one_of(st.integers(0, 5), _ints))
        if draw(st.booleans()):
            key["cache_salt"] = draw(_salts)
        e = {"key": key}
        if draw(st.booleans()):
            e["size_bytes"] = draw(st.one_of(st.integers(0, 1 << 40), _ints))
        if draw(st.booleans()):
            e["token_offset"] = draw(st.one_of(st.integers(-1, 1 << 20), _ints))
        if draw(st.integers(0, 9)):
            e["token_ids"] = draw(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**33)), max_size=300)
                                  if draw(st.integers(0, 9)) else st.lists(_ints, max_size=3))
        if not draw(st.integers(0, 9)):  # unknown fields, some a known name's prefix or extension
            e[draw(st.sampled_from(["token_offsets", "size_byte", "x", "keys"]))] = draw(st.integers(0, 5))
        if not draw(st.integers(0, 9)):
            key[draw(st.sampled_from(["kv_rankk", "model", "cache_salt_"]))] = draw(st.integers(0, 5))
        if not draw(st.integers(0, 19)):
            e["tokens_b64"] = draw(st.sampled_from(["", "AQAAAA==", None, "!!"]))
        if not draw(st.integers(0, 19)):
            del e[draw(st.sampled_from(sorted(e)))]
        out.append(e)
    return out


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(_entries(), st.sampled_from(["store", "delete", "access", "config"])), min_size=1,
                max_size=3), st.booleans())
def test_any_body_gets_the_same_answer_as_the_ordinary_parser(batches, pretty):
    payload = {"batches": [{"instance_id": "i", "incarnation": 0, "seq": k + 1, "event_type": kind, "tier": "l1",
                            "backend": "b", "entries": entries} for k, (entries, kind) in enumerate(batches)]}
    raw = json.dumps(payload, indent=1 if pretty else None).encode()
    _same_as_oracle(raw)
