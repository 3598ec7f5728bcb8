"""The one token decoder (both lookup endpoints) and the lookup request schema."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pydantic import ValidationError

from blendmatch.service.schemas import BlendBatchLookupRequest, BlendLookupRequest
from blendmatch.index.tokens import MAX_TOKEN_ID, TokenDecodeError, b64_token_count, decode_b64_many, decode_tokens, encode_tokens


def b64(ids) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<u4").tobytes()).decode()


def test_b64_roundtrip_little_endian():
    ids = [0, 1, 255, 256, 65536, MAX_TOKEN_ID]
    out = decode_tokens(tokens_b64=b64(ids))
    assert out.dtype == np.uint32 and out.tolist() == ids
    assert not out.flags.writeable
    assert encode_tokens(ids) == b64(ids)
    assert decode_tokens(tokens_b64=base64.b64encode(b"\x01\x00\x00\x00").decode()).tolist() == [1]


def test_empty_forms_decode_to_empty():
    assert decode_tokens(tokens_b64="").size == 0
    assert decode_tokens(token_ids=[]).size == 0


@pytest.mark.parametrize("value, needle", [
    ("abc", "base64"),  # not a multiple of 4 characters
    ("AAAA AAAA", "base64"),  # whitespace is not in the alphabet (strict)
    ("AA-_", "base64"),  # urlsafe alphabet is not standard base64
    ("AAA=", "multiple of 4"),  # 2 bytes
    ("AAAAAAA=", "multiple of 4"),  # 5 bytes
])
def test_b64_strict_errors_name_the_field(value, needle):
    with pytest.raises(TokenDecodeError, match=needle) as ei:
        decode_tokens(tokens_b64=value)
    assert ei.value.field == "tokens_b64" and str(ei.value).startswith("tokens_b64")
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("ids, needle", [
    ([1, -1], "got -1"),
    ([2**32], "got 4294967296"),
    ([1, 2**64], ">= 2\\^63"),
    ([1, True], "bool"),
    ([1.0], "float"),
    (["1"], "str"),
    ("123", "list of integers"),
])
def test_token_ids_errors_name_the_field(ids, needle):
    with pytest.raises(TokenDecodeError, match=needle) as ei:
        decode_tokens(token_ids=ids)
    assert ei.value.field == "token_ids"


def test_both_or_neither_form():
    with pytest.raises(TokenDecodeError, match="both"):
        decode_tokens(tokens_b64="", token_ids=[])
    with pytest.raises(TokenDecodeError, match="neither"):
        decode_tokens()


def test_numpy_input_is_not_mutated():
    arr = np.arange(5, dtype=np.uint32)
    out = decode_tokens(token_ids=arr)
    assert arr.flags.writeable and not out.flags.writeable
    with pytest.raises(TokenDecodeError):
        decode_tokens(token_ids=np.array([1.5]))


def test_request_model_checks_shape_and_builds_namespace():
    r = BlendLookupRequest.model_validate({"tokens_b64": b64([7, 8]), "model_name": "m", "world_size": 2,
                                           "cache_salt": "s", "unknown_field": 1})
    assert r.tokens_b64 == b64([7, 8]) and r.token_ids is None
    assert tuple(r.namespace) == ("m", "s", 2)
    r = BlendLookupRequest.model_validate({"token_ids": [7, 8], "model_name": "m"})
    assert r.token_ids == [7, 8] and r.world_size == 1 and r.cache_salt == ""


@pytest.mark.parametrize("body, needle", [
    ({"token_ids": [1]}, "model_name"),
    ({"token_ids": [1], "model_name": ""}, "model_name"),
    ({"token_ids": [1], "model_name": 3}, "model_name"),
    ({"token_ids": [1], "model_name": "m", "world_size": 0}, "world_size"),
    ({"token_ids": [1], "model_name": "m", "world_size": "2"}, "world_size"),
    ({"token_ids": [1], "model_name": "m", "world_size": True}, "world_size"),
    ({"token_ids": [1], "model_name": "m", "cache_salt": None}, "cache_salt"),
    ({"token_ids": "1,2", "model_name": "m"}, "token_ids"),
    ({"token_ids": [1, "2"], "model_name": "m"}, "token_ids"),
    ({"token_ids": [1, True], "model_name": "m"}, "token_ids"),
    ({"tokens_b64": 5, "model_name": "m"}, "tokens_b64"),
    ({"model_name": "m"}, "neither"),
    ({"tokens_b64": "", "token_ids": [], "model_name": "m"}, "both"),
])
def test_request_model_rejects(body, needle):
    with pytest.raises(ValidationError) as ei:
        BlendLookupRequest.model_validate(body)
    assert needle in str(ei.value)


def test_batch_request_validates_each_query():
    ok = BlendBatchLookupRequest.model_validate({"queries": [{"token_ids": [1], "model_name": "a"},
                                                             {"tokens_b64": b64([2]), "model_name": "b"}]})
    assert [q.model_name for q in ok.queries] == ["a", "b"]
    with pytest.raises(ValidationError, match="queries"):
        BlendBatchLookupRequest.model_validate({"queries": [{"token_ids": [1], "model_name": ""}]})
    with pytest.raises(ValidationError, match="queries"):
        BlendBatchLookupRequest.model_validate({})


def _python_reference(s: str):
    """What Python's strict decoder says (our rule adds: length a multiple of 4)."""
    import binascii

    if len(s) % 4:
        return "bad"
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        return "bad"
    return "len" if len(raw) % 4 else raw


def test_batch_decoder_agrees_with_python_on_random_strings():
    rng = np.random.default_rng(5)
    alphabet = list("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/= -_\n")
    cases = []
    for t in range(6000):
        if t % 2:
            s = base64.b64encode(rng.bytes(int(rng.integers(0, 24)))).decode()
            if s and rng.random() < 0.5:
                i = int(rng.integers(len(s)))
                s = s[:i] + str(rng.choice(alphabet)) + s[i + 1:]
        else:
            s = "".join(rng.choice(alphabet, size=int(rng.integers(0, 13))))
        cases.append(s)
    cases += ["", "AAAA", "AA==", "AAA=", "====", "A===", "AA=A", "\u00e9AAA"]
    got = decode_b64_many(cases)
    for s, g in zip(cases, got, strict=True):
        want = _python_reference(s)
        if isinstance(g, TokenDecodeError):
            assert want in ("bad", "len"), (s, g)
            assert ("multiple of 4 (little-endian" in str(g)) == (want == "len"), (s, g)
        else:
            assert want not in ("bad", "len") and g.tobytes() == want, s
            assert b64_token_count(s) == g.size


def test_batch_decoder_isolates_failures():
    good, bad = b64([1, 2, 3]), "AA*A"
    out = decode_b64_many([good, bad, 5, "é", good])
    assert out[0].tolist() == [1, 2, 3] and out[4].tolist() == [1, 2, 3]
    assert isinstance(out[1], TokenDecodeError) and "'*' at position 2" in str(out[1])
    assert isinstance(out[2], TokenDecodeError) and "string" in str(out[2])
    assert isinstance(out[3], TokenDecodeError) and "non-ASCII" in str(out[3])
    assert decode_b64_many([]) == []


def test_query_batch_decodes_into_one_flat_buffer_without_copying_the_text():
    """The lookup thread's decoder: every query that decodes lies back to back in one
    uint32 buffer (what the index probes), base64 read where it lies (a memoryview of the
    request body, as the fast path takes it), a bad query gets its error and no span."""
    from blendmatch.index import BlendIndex, BlendNamespace
    from blendmatch.index.tokens import decode_query_tokens, split_b64_value

    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32) for n in (9, 20, 4))
    body = ('{"tokens_b64": "%s", "model_name": "m"}' % b64(b)).encode()
    view, _ = split_b64_value(body)
    assert isinstance(view, memoryview) and view.obj is body  # the body's own bytes, not a copy
    sources = [b64(a), "AAA*", view, c, b"\xff\xfe"]
    tokens, offsets, errors = decode_query_tokens(sources)
    assert tokens.dtype == np.uint32 and not tokens.flags.writeable
    assert tokens.tolist() == np.concatenate([a, b, c]).tolist() and offsets.tolist() == [0, 9, 29, 33]
    want = decode_b64_many(["AAA*"])[0]
    assert [type(e).__name__ for e in errors] == ["NoneType", "TokenDecodeError", "NoneType", "NoneType",
                                                  "TokenDecodeError"]
    assert str(errors[1]) == str(want)
    idx = BlendIndex(chunk_size=4, engine="cpu")
    ns = BlendNamespace("m")
    idx.add(b[4:8], b"h", 0, ns)
    idx.add(c, b"k", 4, ns)
    flat, _ = idx.match_flat(tokens, offsets, [ns, ns, ns])
    assert flat == idx.match_batch([(a, ns), (b, ns), (c, ns)])
    assert [len(r) for r in flat] == [0, 1, 1]


def test_b64_errors_name_the_first_bad_character_of_a_long_string():
    """pybase64 refuses; the vectorised second pass names where (the same messages as the
    kernel it replaced): a bad character deep in a long string, '=' too early, a bad length."""
    good = b64(list(range(30_000)))
    bad = good[:100_001] + "*" + good[100_002:]
    got = decode_b64_many([bad, good[:-4] + "=AAA", good + "A", "AB=A", "A==="])
    assert "'*' at position 100001" in str(got[0])
    assert f"padding '=' at character {len(good) - 4}" in str(got[1])
    assert "length 160001 is not a multiple of 4" in str(got[2])
    assert "padding '=' at character 2" in str(got[3]) and "padding '=' at character 1" in str(got[4])


def test_bench_b64_compares_decoders_and_checks_their_answers():
    from blendmatch.bench import b64 as bench_b64

    row = bench_b64.run({"ours": bench_b64.decode_query_tokens, "binascii": bench_b64._binascii}, 64, 3, rounds=1)
    assert set(row["us_per_call"]) == {"ours", "binascii"} and row["x_ours"]["ours"] == 1.0
