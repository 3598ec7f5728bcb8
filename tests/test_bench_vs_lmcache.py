"""``blendmatch bench --vs-lmcache``: LMCache 0.5.6's own BlendIndex on the same data finds
the same matches. Needs an unzipped LMCache wheel with its torch stand-ins beside it
(docs/lmcache.md (k)); skipped without one. ``BLENDMATCH_LMCACHE_WHEEL`` names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

WHEEL = Path(os.environ.get("BLENDMATCH_LMCACHE_WHEEL", "/work/lmcache/wheel"))


@pytest.mark.skipif(not (WHEEL / "lmcache").is_dir() or not (WHEEL.parent / "stubs").is_dir(),
                    reason="no unzipped LMCache 0.5.6 wheel with stubs beside it")
def test_vs_lmcache_same_matches():
    from blendmatch.bench.engine import run_vs_lmcache

    res = run_vs_lmcache(str(WHEEL), chunks=2000, engine="cpu", queries=2, query_tokens=4096, hit_fraction=0.25,
                         repeat=1, progress=False)
    assert res["ours"]["matches"] == res["lmcache"]["lmcache_matches"] > 0
    assert res["ratio"] > 0
