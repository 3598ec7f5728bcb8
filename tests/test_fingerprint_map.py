"""The fingerprint map's rehash: the one-pass kernel builds the very table that gathering
the live entries and inserting them in slot order builds (the same probe chains: a
checkpoint stores the table as it is, and replicas compare their states)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blendmatch.index.storage import EMPTY, FingerprintMap, _empty_map, _fm_insert


def _gathered(fm: FingerprintMap, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The rehash as it was: live entries gathered by a mask, then inserted in order."""
    live = fm.vals >= 0
    keys, vals = _empty_map(cap)
    _fm_insert(keys, vals, cap - 1, fm.keys[live], fm.vals[live])
    return keys, vals


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), deleted=st.floats(0, 0.9), colliding=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rehash_builds_the_gathered_table(n, deleted, colliding, seed):
    rng = np.random.default_rng(seed)
    hi = 64 if colliding else 1 << 63  # few distinct values: long probe chains
    fps = np.unique(rng.integers(0, hi, size=n, dtype=np.uint64))
    fm = FingerprintMap(capacity=1024)
    fm.insert(fps, np.arange(fps.size, dtype=np.int64))
    for fp in fps[rng.random(fps.size) < deleted]:  # tombstones in the old table
        assert fm.delete(int(fp))
    need = fm.live + 10
    keys, vals = fm._rehashed(need)
    ref_keys, ref_vals = _gathered(fm, keys.shape[0])
    assert np.array_equal(keys, ref_keys) and np.array_equal(vals, ref_vals)
    assert int((vals >= 0).sum()) == fm.live and not (vals == -2).any()  # no tombstones carried
    rows_before = fm.lookup(fps)
    fm.adopt((keys, vals))
    assert np.array_equal(fm.lookup(fps), rows_before)  # every live key keeps its row, deleted ones stay absent
    assert EMPTY == -1


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 2000), colliding=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_lookup_in_hold_answers_as_lookup(n, colliding, seed):
    """The GIL-keeping lookup (a verification's, under the index lock) is the same probe."""
    rng = np.random.default_rng(seed)
    hi = 64 if colliding else 1 << 63
    fps = np.unique(rng.integers(0, hi, size=n, dtype=np.uint64))
    fm = FingerprintMap(capacity=1024)
    fm.insert(fps, np.arange(fps.size, dtype=np.int64))
    for fp in fps[rng.random(fps.size) < 0.3]:
        fm.delete(int(fp))
    asked = np.concatenate([fps, rng.integers(0, hi, size=64, dtype=np.uint64)])
    assert np.array_equal(fm.lookup_in_hold(asked), fm.lookup(asked))
