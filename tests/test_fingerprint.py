"""THE fingerprint: golden vectors, the three forms against big integers, slot/tag rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blendmatch.gpu import fingerprint as fpm
from blendmatch.index.tokens import as_tokens
from blendmatch.gpu.fingerprint import (
    chunk_fingerprint,
    chunk_fingerprints,
    prefix_fingerprints,
    rolling_fingerprints,
    slots_and_tags,
)
from oracle import big_fingerprint, thue_morse

U32 = 0xFFFFFFFF


def test_golden_vectors_from_design():
    assert chunk_fingerprint([1, 2, 3, 4]) == 0xF9792455C84F1FE2
    assert chunk_fingerprint([0, 0, 0, 0]) == 0
    expect = [0xCA54B48F2C446FE0, 0x875EE571F5FE9795, 0xC56F46159F4F5DBE, 0xA33549D59AC12BB5]
    q = [7, 8, 10, 11, 12, 13, 9]
    assert [int(x) for x in rolling_fingerprints(q, 4)] == expect
    assert [int(x) for x in prefix_fingerprints(np.array(q, dtype=np.uint32), 4)] == expect
    assert chunk_fingerprint(np.arange(1000, 1256)) == 0x6B39A22DAE200F80
    assert big_fingerprint(list(range(1000, 1256))) == 0x6B39A22DAE200F80


@pytest.mark.parametrize("tokens", [[0] * 8, [U32] * 8, [0, U32] * 4, [U32, 0, 1, 2, 3, U32, U32, 0]])
def test_extreme_tokens_match_big_integers(tokens):
    assert chunk_fingerprint(tokens) == big_fingerprint(tokens)
    assert int(chunk_fingerprints(np.array([tokens], dtype=np.uint32))[0]) == big_fingerprint(tokens)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, U32), min_size=0, max_size=80), st.integers(1, 12))
def test_three_forms_agree_with_big_integers(tokens, c):
    q = np.array(tokens, dtype=np.uint32)
    expect = [big_fingerprint(tokens[j:j + c]) for j in range(len(tokens) - c + 1)]
    assert [int(x) for x in rolling_fingerprints(q, c)] == expect
    assert [int(x) for x in prefix_fingerprints(q, c)] == expect
    if len(tokens) >= c:
        windows = np.lib.stride_tricks.sliding_window_view(q, c)
        assert [int(x) for x in chunk_fingerprints(windows)] == expect


def test_prefix_form_with_long_query_and_chunk_256():
    rng = np.random.default_rng(7)
    q = rng.integers(0, 1 << 32, size=3000, dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(prefix_fingerprints(q, 256), rolling_fingerprints(q, 256))
    assert int(rolling_fingerprints(q, 256)[1234]) == big_fingerprint(q[1234:1490].tolist())


def test_thue_morse_pair_collides_as_theory_says():
    t = thue_morse(11)
    u = [1 - x for x in t]
    assert t != u and chunk_fingerprint(t) == chunk_fingerprint(u) == big_fingerprint(u)


def test_slot_and_tag_ranges_and_mixing():
    h = np.arange(0, 100_000, dtype=np.uint64)  # low bits of F are weak: consecutive values
    slots, tags = slots_and_tags(h, (1 << 12) - 1)
    assert slots.min() >= 0 and slots.max() < 4096
    assert tags.min() >= 1 and tags.max() <= 254
    # mixed: consecutive fingerprints spread over the table and over all tags
    assert np.unique(slots).size > 4000 and np.unique(tags).size == 254
    assert np.array_equal(fpm.slot_of(h, 4095), slots) and np.array_equal(fpm.tag_of(h), tags)


@pytest.mark.parametrize("bad, msg", [
    ([1, -1], ">= 0"),
    ([1, 1 << 32], "< 2^32"),
    (np.array([1.0, 2.0]), "dtype float64"),
    (np.array([True]), "dtype bool"),
    ([[1, 2]], "1-D"),
    (["a"], "dtype <U1"),
])
def test_bad_tokens_raise_value_error_naming_the_problem(bad, msg):
    with pytest.raises(ValueError, match=msg.replace("^", r"\^")):
        as_tokens(bad)


def test_lossless_conversions_accepted():
    assert as_tokens([1, 2, U32]).dtype == np.uint32
    assert as_tokens(np.array([5], dtype=np.int64)).tolist() == [5]
    assert as_tokens([]).size == 0
    assert as_tokens([U32, 1 << 31]).tolist() == [U32, 1 << 31]
    a = np.arange(4, dtype=np.uint32)
    assert as_tokens(a) is a  # no copy for the native dtype


def test_short_input_gives_no_windows():
    assert rolling_fingerprints([1, 2, 3], 4).size == 0
    assert prefix_fingerprints(np.array([1, 2], dtype=np.uint32), 4).size == 0
    with pytest.raises(ValueError):
        rolling_fingerprints([1, 2, 3], 0)
