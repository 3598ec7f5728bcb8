"""``token_ids`` taken straight out of the JSON text (``tokens.split_token_arrays``): the
events body and the lookup fast path must accept, reject and answer exactly what the
ordinary decode-then-validate path does."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from pydantic_core import from_json

from blendmatch.index import tokens as tokens_mod
from blendmatch.index.tokens import split_token_arrays
from blendmatch.index.types import pack_kv_rank
from blendmatch.index.wire import EventValidationError, parse_event_body, parse_event_request

from service_support import MODEL, b64, chunks, config, events, served, store


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def split_everything(monkeypatch):
    """Split bodies of any size (the production threshold skips small ones)."""
    monkeypatch.setattr(tokens_mod, "SPLIT_MIN_BYTES", 0)


def test_split_takes_every_token_ids_array(split_everything):
    body = (b'{"token_ids" :\n [ 0 , 4294967295,7 ] , "x": "token_ids", "y": {"token_ids": []},'
            b' "z": ["token_ids", 1], "token_idsx": [1.5]}')
    got = split_token_arrays(body)
    assert got is not None and len(got) == 2
    assert got.row(0).tolist() == [0, 4294967295, 7] and got.row(1).tolist() == []
    assert not got.row(0).flags.writeable
    assert json.loads(got.text) == {"token_ids": 0, "x": "token_ids", "y": {"token_ids": 1},
                                    "z": ["token_ids", 1], "token_idsx": [1.5]}
    empty = split_token_arrays(body, placeholder="empty")
    assert json.loads(empty.text)["token_ids"] == [] and json.loads(empty.text)["y"] == {"token_ids": []}


@pytest.mark.parametrize("value", ["[1.0]", "[-1]", "[01]", "[1e3]", "[4294967296]", "[99999999999]", "[true]",
                                   "null", "5", '"1"', "[[1]]", "[1,]", "[1 2]", "[,1]", "[1", "{}"])
def test_split_leaves_anything_unusual_to_the_ordinary_parser(split_everything, value):
    assert split_token_arrays(('{"a": [1], "token_ids": %s}' % value).encode()) is None


def test_split_refuses_bodies_with_escapes_or_without_the_key(split_everything):
    assert split_token_arrays(b'{"m": "a\\"b", "token_ids": [1]}') is None
    assert split_token_arrays(b'{"\\u0074oken_ids": [1], "token_ids": [2]}') is None
    assert split_token_arrays(b'{"tokens": [1, 2]}') is None
    assert split_token_arrays(b'{"token_ids": [1, 2]') is not None  # truncated later: the JSON parser says so


def test_small_bodies_are_not_split():
    assert split_token_arrays(b'{"token_ids": [1, 2, 3]}') is None


# ---------------------------------------------------------------------------- events bodies

def _canonical(raw: bytes):
    """What the ordinary path makes of ``raw``: a comparable summary, or the error."""
    try:
        req = parse_event_request(from_json(raw))
    except EventValidationError as exc:
        return ("invalid", exc.loc, exc.reason)
    except ValueError as exc:
        return ("json", str(exc))
    return _summary(req)


def _split(raw: bytes):
    try:
        req = parse_event_body(raw)
    except EventValidationError as exc:
        return ("invalid", exc.loc, exc.reason)
    except ValueError as exc:
        return ("json", str(exc))
    return _summary(req)


def _summary(req):
    out = []
    for b in req.batches:
        e = b.entries
        toks = e.tokens
        rows = [None if toks.row(i) is None else toks.row(i).tolist() for i in range(len(e))]
        out.append((b.instance_id, b.seq, b.event_type, e.chunk_hashes, [tuple(s) for s in e.scopes], e.sizes,
                    e.offsets, toks.lengths, sorted(toks.unfilled), rows))
    return out


def _body(rng: random.Random, n_batches: int = 2, n_entries: int = 4) -> dict:
    batches = []
    for b in range(n_batches):
        entries = []
        for i in range(n_entries):
            entries.append({"key": {"chunk_hash_hex": f"{rng.getrandbits(64):016x}", "model_name": MODEL,
                                    "kv_rank": pack_kv_rank(1, 0), "object_group_id": 0, "cache_salt": ""},
                            "size_bytes": rng.randrange(1 << 20), "token_offset": 0,
                            "token_ids": [rng.randrange(1 << 32) for _ in range(rng.choice([0, 3, 16]))]})
        batches.append({"instance_id": "i", "incarnation": 0, "seq": b + 1, "event_type": "store", "tier": "l1",
                        "backend": "LocalCPUBackend", "entries": entries})
    return {"batches": batches}


_BAD_IDS = ["-1", "1.0", "1e3", "01", "4294967296", "true", "null", '"5"', "[1]", "18446744073709551616"]


def _mutate(rng: random.Random, text: str) -> str:
    choice = rng.randrange(9)
    if choice == 0:  # one bad token id
        i = text.find("[", text.find('"token_ids"'))
        return text if i < 0 else text[:i + 1] + rng.choice(_BAD_IDS) + "," + text[i + 1:]
    if choice == 1:  # an escape somewhere
        return text.replace('"LocalCPUBackend"', '"Local\\u0043PUBackend"', 1)
    if choice == 2:  # an entry without token_ids
        return text.replace(', "token_ids": [', ', "token_idz": [', 1)
    if choice == 3:  # an unknown nested token_ids (ignored field)
        return text.replace('"cache_salt": ""', '"cache_salt": "", "token_ids": [5, 6]', 1)
    if choice == 4:  # the key given twice in one entry: the last counts
        return text.replace('"token_offset": 0,', '"token_ids": [9, 9, 9], "token_offset": 0,', 1)
    if choice == 5:  # broken JSON
        return text[: rng.randrange(len(text))]
    if choice == 6:  # a bad non-token field
        return text.replace('"kv_rank": ', '"kv_rank": -', 1)
    if choice == 7:  # tokens_b64 beside token_ids
        return text.replace('"token_offset": 0,', '"tokens_b64": "AQAAAA==", "token_offset": 0,', 1)
    return text.replace(", ", ",\n  ")  # whitespace


def test_events_body_split_matches_the_ordinary_path(split_everything):
    rng = random.Random(12)
    for trial in range(400):
        text = json.dumps(_body(rng, rng.randrange(1, 3), rng.randrange(1, 5)))
        for _ in range(rng.randrange(3)):
            text = _mutate(rng, text)
        raw = text.encode()
        assert _split(raw) == _canonical(raw), (trial, text[:400])


def test_events_body_split_at_production_size():
    rng = random.Random(5)
    body = _body(rng, 1, 40)
    for e in body["batches"][0]["entries"]:
        e["token_ids"] = [rng.randrange(1 << 32) for _ in range(256)]
    raw = json.dumps(body).encode()
    assert len(raw) > tokens_mod.SPLIT_MIN_BYTES and split_token_arrays(raw) is not None
    assert _split(raw) == _canonical(raw)
    assert parse_event_body(raw).batches[0].entries.tokens.rows_of_length(256)


# ---------------------------------------------------------------------------- lookups

@pytest.mark.anyio
async def test_token_ids_lookups_through_the_split_answer_as_b64(split_everything):
    rows = chunks(3, seed=4)
    async with served(config()) as (client, _):
        assert (await client.post("/events", json=events(store("a", 1, rows)))).status_code == 200
        query = np.concatenate([np.arange(50_000, 50_100, dtype=np.uint32), rows[1], rows[2]])
        want = (await client.post("/directory/blend-lookup", json={"tokens_b64": b64(query), "model_name": MODEL})).json()
        assert len(want["matches"]) == 2
        got = await client.post("/directory/blend-lookup", json={"token_ids": query.tolist(), "model_name": MODEL})
        assert got.json() == want
        # an unknown nested token_ids field: validated as sent (the mapping would be ambiguous)
        got = await client.post("/directory/blend-lookup", json={"token_ids": query.tolist(), "model_name": MODEL,
                                                                 "extra": {"token_ids": [1, 2]}})
        assert got.json() == want
        batch = {"queries": [{"token_ids": query.tolist(), "model_name": MODEL},
                             {"tokens_b64": b64(query), "model_name": MODEL},
                             {"token_ids": [], "model_name": MODEL},
                             {"token_ids": rows[0].tolist(), "model_name": MODEL}]}
        got = (await client.post("/directory/blend-lookup/batch", json=batch)).json()["results"]
        assert got[0] == want and got[1] == want and got[2] == {"matches": []} and len(got[3]["matches"]) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("bad, detail", [
    ("-1", "body.token_ids: item 2000: ids must lie in 0..4294967295 (>= 0 and < 2^32), got -1"),
    ("1.5", "body.token_ids.2000: Input should be a valid integer, got 1.5"),
    ("true", "body.token_ids.2000: Input should be a valid integer, got True"),
    ("4294967296", "body.token_ids: item 2000: ids must lie in 0..4294967295 (>= 0 and < 2^32), got 4294967296"),
])
async def test_bad_token_ids_in_large_lookups_get_the_routes_error(bad, detail):
    """Bodies over the split threshold with one bad id: the route's own 422, word for word."""
    raw = ('{"model_name": "%s", "token_ids": [%s, %s]}' % (MODEL, ",".join(["7"] * 2000), bad)).encode()
    assert len(raw) > tokens_mod.SPLIT_MIN_BYTES
    async with served(config()) as (client, _):
        r = await client.post("/directory/blend-lookup", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"] == detail


# ---------------------------------------------------------------------------- POST /events fast path

@pytest.mark.anyio
async def test_events_fast_path_answers_as_the_route():
    """With a Content-Length the fast path answers; streamed (chunked, no Content-Length) the
    FastAPI route does: replies, duplicates and every kind of error are the same bytes."""
    rows = chunks(4, seed=9)
    good = json.dumps(events(store("a", 1, rows[:2]))).encode()
    good2 = json.dumps(events(store("b", 1, rows[2:], first_hash=2))).encode()
    bad_key = good.replace(b'"kv_rank": ', b'"kv_rank": -', 1)
    cases = [good, good, bad_key, b"{not json", b"", b'{"batches": 5}']

    async def streamed(body: bytes):
        yield body

    async with served(config()) as (fast_client, _), served(config()) as (route_client, _):
        for body in cases + [good2]:
            fast = await fast_client.post("/events", content=body, headers={"content-type": "application/json"})
            route = await route_client.post("/events", content=streamed(body),
                                            headers={"content-type": "application/json"})
            assert (fast.status_code, fast.content) == (route.status_code, route.content), body[:80]
        stats = [(await c.get("/directory/stats")).json()["num_keys"] for c in (fast_client, route_client)]
        assert stats[0] == stats[1] == 4


# ---------------------------------------------------------------------------- tokens_b64 lookups

def test_split_b64_value_takes_only_the_plain_case():
    from blendmatch.index.tokens import split_b64_value

    assert split_b64_value(b'{"tokens_b64": "AAAA", "model_name": "m"}') == (b"AAAA", b'{"tokens_b64": "", "model_name": "m"}')
    assert split_b64_value(b'{"tokens_b64"\n:\t"AQID"}') == (b"AQID", b'{"tokens_b64"\n:\t""}')
    for body in (b'{"model_name": "m", "tokens_b64": "AAAA"}',  # not the first key
                 b'{"tokens_b64": "AA\\u0041A", "model_name": "m"}',  # an escape
                 b'{"tokens_b64": "AA\xc3\xa9A", "model_name": "m"}',  # non-ASCII
                 b'{"tokens_b64": "AAAA", "tokens_b64": "BBBB"}',  # a second key
                 b'{"tokens_b64": "AAAA", "tokens\\u005fb64": ""}',  # one spelled with an escape
                 b'{"tokens_b64": 5}', b'{"tokens_b64": "AAAA', b'{"tokens_b64" "AAAA"}'):
        assert split_b64_value(body) is None, body


def test_decode_b64_many_takes_bytes_as_strings():
    from blendmatch.index.tokens import decode_b64_many

    values = ["AQAAAAIAAAA=", "AQAAAAIAAA", "AQ*AAAAA", "", "AQAAAA=A"]
    as_str = decode_b64_many(values)
    as_bytes = decode_b64_many([v.encode() for v in values], ascii_bytes=True)
    for a, b in zip(as_str, as_bytes, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert type(a) is type(b) and str(a) == str(b)
    assert "got bytes" in str(decode_b64_many([b"AQAAAA=="])[0])  # only where asked for


@pytest.mark.anyio
async def test_b64_lookups_through_the_fast_path_answer_as_the_route():
    """Single ``tokens_b64`` lookups: the fast path takes the string out of the body; the
    FastAPI route (a streamed body) validates it whole. Same status and bytes for plain
    bodies, JSON whitespace, escapes, non-ASCII, bad base64, a repeated key, both forms."""
    rows = chunks(3, seed=5)
    query = np.concatenate([np.arange(50_000, 50_600, dtype=np.uint32), rows[1], rows[2]])
    q64 = b64(query)
    other = b64(rows[0])
    m = json.dumps(MODEL)
    escaped = q64[:100] + "\\u00" + format(ord(q64[100]), "02x") + q64[101:]
    cases = [
        '{"tokens_b64": "%s", "model_name": %s}' % (q64, m),
        '{"tokens_b64":"%s","model_name":%s}' % (q64, m),
        '{"tokens_b64" :\n "%s" , "model_name": %s, "extra": {"tokens_b64": 1}}' % (q64, m),
        '{"tokens_b64": "%s", "model_name": %s}' % (escaped, m),
        '{"tokens_b64": "%s\u00e9", "model_name": %s}' % (q64[:-4], m),
        '{"tokens_b64": "%s*AAA", "model_name": %s}' % (q64[:-8], m),
        '{"tokens_b64": "%s=AAA", "model_name": %s}' % (q64[:-8], m),
        '{"tokens_b64": "%s", "model_name": %s, "tokens_b64": "%s"}' % (q64, m, other),
        '{"tokens_b64": "%s", "model_name": %s, "tokens_b64": ""}' % (q64, m),  # the last (empty) one counts
        '{"tokens_b64": "%s", "model_name": %s, "tokens\\u005fb64": ""}' % (q64, m),  # the same, key escaped
        '{"tokens_b64": "%s", "token_ids": [1], "model_name": %s}' % (q64, m),
        '{"tokens_b64": "", "model_name": %s}' % m,
        '{"tokens_b64": "%s"}' % q64,
        '{"tokens_b64": "%s", "model_name": %s, "world_size": 0}' % (q64, m),
        '{"tokens_b64": "%s", "model_name": }' % q64,
        '{"tokens_b64": "%s", "model_name": %s' % (q64, m),
    ]

    async def streamed(body: bytes):
        yield body

    async with served(config()) as (fast_client, _), served(config()) as (route_client, _):
        for c in (fast_client, route_client):
            assert (await c.post("/events", json=events(store("a", 1, rows)))).status_code == 200
        statuses = []
        for text in cases:
            body = text.encode()
            fast = await fast_client.post("/directory/blend-lookup", content=body,
                                          headers={"content-type": "application/json"})
            route = await route_client.post("/directory/blend-lookup", content=streamed(body),
                                            headers={"content-type": "application/json"})
            assert (fast.status_code, fast.content) == (route.status_code, route.content), text[:60] + text[-60:]
            statuses.append(fast.status_code)
        assert statuses[:4] == [200] * 4 and statuses[4:7] == [422] * 3 and statuses[7:12] == [200, 200, 200, 422, 200]
        got = await fast_client.post("/directory/blend-lookup", content=cases[0].encode(),
                                     headers={"content-type": "application/json"})
        assert len(got.json()["matches"]) == 2


# ---------------------------------------------------------------------------- the lookup fast path, differential

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ABSENT = object()
_lookup_fields = st.fixed_dictionaries({
    # weighted to valid values, so that most bodies pass and their values are compared
    "model_name": st.sampled_from([MODEL] * 6 + ["", 5, None, _ABSENT]),
    "token_ids": st.one_of(st.just(_ABSENT), st.none(), st.just("1"),
                           st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(-2, 2**33),
                                              st.sampled_from([1.0, 1.5, True])), max_size=40),
                           st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3000)),
    "tokens_b64": st.sampled_from([_ABSENT] * 6 + [None, "", "AQAAAA==", "AQAAAAIAAAA=", "!!", "AQ", 5, "AQAA\u00e9AAA"]),
    "world_size": st.sampled_from([_ABSENT] * 3 + [1, 2, 0, 1.0, "2"]),
    "cache_salt": st.sampled_from([_ABSENT] * 3 + ["", "t", 3]),
    "extra": st.sampled_from([_ABSENT, 1, {"token_ids": [1]}, {"token_ids": [1]}, ["tokens_b64"]]),
})


def _errors(exc: Exception):
    errors = getattr(exc, "errors", None)
    if errors is None:
        return (type(exc).__name__, str(exc))
    return [(e["type"], e["loc"], e["msg"]) for e in errors()]


@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_lookup_fields, st.randoms(use_true_random=False), st.booleans())
def test_lookup_fast_path_agrees_with_the_model(fields, rnd, pretty):
    """``fastpath.parse_body`` (with ``split_token_arrays`` and ``split_b64_value`` under it)
    against the route's own model on the same bytes: the same accept or refuse (the same
    errors), the same values; the ids it takes out are the model's ``token_ids``, the
    string it leaves in place the model's ``tokens_b64``."""
    from blendmatch.service.fastpath import parse_body
    from blendmatch.service.schemas import BlendLookupRequest

    items = [(k, v) for k, v in fields.items() if v is not _ABSENT]
    rnd.shuffle(items)
    if rnd.random() < 0.5:  # the b64 fast path wants the string first
        items.sort(key=lambda kv: kv[0] != "tokens_b64")
    raw = json.dumps(dict(items), indent=1 if pretty else None, ensure_ascii=False).encode()
    saved = tokens_mod.SPLIT_MIN_BYTES
    tokens_mod.SPLIT_MIN_BYTES = 0  # split bodies of any size
    try:
        try:
            want = BlendLookupRequest.model_validate_json(raw)
        except ValueError as exc:
            want_err = _errors(exc)
            with pytest.raises(ValueError) as got:
                parse_body(BlendLookupRequest, raw)
            assert _errors(got.value) == want_err, raw[:200]
            return
        model, taken = parse_body(BlendLookupRequest, raw)
    finally:
        tokens_mod.SPLIT_MIN_BYTES = saved
    dump, want_dump = model.model_dump(), want.model_dump()
    if taken is not None and want.token_ids is not None:  # ids taken out as uint32
        assert model.token_ids == [] and np.asarray(taken).tolist() == want.token_ids
        dump["token_ids"] = want_dump["token_ids"]
    elif taken is not None:  # the tokens_b64 string left where it lies
        assert model.tokens_b64 == "" and bytes(taken) == want.tokens_b64.encode()
        dump["tokens_b64"] = want_dump["tokens_b64"]
    assert dump == want_dump
