"""The one token-id rule of both numba splitters (``_jsontok.token_array``) against json.

The rule: a ``token_ids`` array is taken only when it is a JSON array of plain decimal
integers in 0..2^32-1 (no sign, no leading zero, no fraction or exponent); anything else
is refused and the body goes to the ordinary parser. ``token_array`` reads up to seven
digits with one eight-byte load and the rest a digit at a time, so the examples cover
every id length from 1 to 11 digits, every alignment, whitespace in every place JSON
allows it, and arrays that end within the last eight bytes of the buffer (where the
eight-byte load is not allowed). The oracle is ``json.loads`` plus the rule.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blendmatch.index import _jsontok

MAX_ID = 2**32 - 1
WS = st.sampled_from(["", "", "", " ", "\n", "\t", "\r", "  "])
BAD = st.sampled_from(["01", "00", "-1", "-0", "1.0", "1e3", "1E3", "4294967296", "12345678901", "99999999999",
                       "null", "true", "", "+1", "0x1", '"1"', "[1]", "1-", "1 2"])


@st.composite
def ids(draw) -> str:
    digits = draw(st.integers(1, 10))
    if digits == 1:
        return str(draw(st.integers(0, 9)))
    return str(draw(st.integers(10 ** (digits - 1), min(10**digits - 1, MAX_ID))))


@st.composite
def arrays(draw) -> str:
    items = draw(st.lists(st.one_of(ids(), ids(), ids(), BAD) if draw(st.booleans()) else ids(), max_size=12))
    text = "[" + draw(WS)
    for k, item in enumerate(items):
        if k:
            text += draw(WS) + "," + draw(WS)
        text += item
    if items and draw(st.integers(0, 20)) == 0:
        text += ","  # a trailing comma: not JSON
    return text + draw(WS) + "]"


def oracle(text: str) -> list[int] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if "-" in text or not isinstance(value, list):
        return None
    if not all(type(v) is int and 0 <= v <= MAX_ID for v in value):
        return None
    return value


def run(text: str, prefix: str, suffix: str, cap: int = 64) -> tuple[int, list[int]]:
    src = np.frombuffer((prefix + text + suffix).encode(), dtype=np.uint8)
    flat = np.zeros(cap, dtype=np.uint32)
    end, t = _jsontok.token_array(src, len(prefix) + 1, src.shape[0], flat, 0)
    return int(end), flat[:t].tolist()


@settings(max_examples=600, deadline=None)
@given(text=arrays(), prefix=st.text("ab", max_size=9), suffix=st.sampled_from(["", "}", ",", '}]}', "} " * 8]))
def test_token_array_agrees_with_json(text: str, prefix: str, suffix: str) -> None:
    want = oracle(text)
    end, got = run(text, prefix, suffix)
    if want is None:
        assert end == -1, (text, end, got)
    else:
        assert (end, got) == (len(prefix) + len(text), want), text


@pytest.mark.parametrize("digits", range(1, 11))
@pytest.mark.parametrize("tail", ["]", "]" + "}" * 16])
def test_every_id_length_near_and_far_from_the_end(digits: int, tail: str) -> None:
    value = min(int("9" * digits), MAX_ID) if digits > 1 else 7
    text = f"[{value},{10 ** (digits - 1)},{value}"
    end, got = run(text + "]", "x", tail[1:])
    assert end == len(text) + 2 and got == [value, 10 ** (digits - 1), value]


@pytest.mark.parametrize("bad", ["[4294967296]", "[12345678901]", "[0123]", "[1,,2]", "[1 2]", "[1,]", "[1",
                                 "[1,2", "[ 1 , -2 ]", "[1.5]", "[12345678.5]", "[123e4]"])
@pytest.mark.parametrize("tail", ["", "}" * 16])
def test_refusals_at_every_distance_from_the_end(bad: str, tail: str) -> None:
    assert run(bad, "", tail)[0] == -1


def test_a_full_buffer_says_so() -> None:
    assert run("[1,2,3]", "", "}", cap=2)[0] == -2
    assert run("[1,2,3]", "", "}", cap=3) == (7, [1, 2, 3])
