"""The lookup answer's JSON (``answers.encode_matches``) against ``json.dumps`` of the same
matches: every count (with and without a kept template), hash widths, numpy integers."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blendmatch.index.types import BlendMatch
from blendmatch.service.answers import _TEMPLATES_KEPT, encode_matches


def _expected(matches: list[BlendMatch]) -> bytes:
    return json.dumps({"matches": [{"chunk_hash": m.chunk_hash.hex(), "old_st": int(m.old_st), "cur_st": int(m.cur_st)}
                                   for m in matches]}, separators=(",", ":")).encode()


_match = st.builds(BlendMatch, st.binary(min_size=1, max_size=32), st.integers(0, 1 << 62), st.integers(0, 1 << 40))


@settings(max_examples=200, deadline=None)
@given(st.lists(_match, max_size=_TEMPLATES_KEPT + 6))
def test_answers_equal_json_dumps(matches):
    assert encode_matches(matches) == _expected(matches)
    assert encode_matches(matches) == _expected(matches)  # again: from the kept template


def test_numpy_integers_and_counts_past_the_kept_templates():
    matches = [BlendMatch(bytes([k % 256]) * 16, np.int64(256 * k), np.int64(7 + k)) for k in range(300)]
    for n in (0, 1, 8, _TEMPLATES_KEPT, _TEMPLATES_KEPT + 1, 300):
        assert encode_matches(matches[:n]) == _expected(matches[:n])
        assert json.loads(encode_matches(matches[:n]))["matches"][:1] == (
            [{"chunk_hash": matches[0].chunk_hash.hex(), "old_st": 0, "cur_st": 7}] if n else [])
