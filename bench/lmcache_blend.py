"""LMCache 0.5.6's own ``BlendIndex`` on the same chunks and queries as ``bench/engine.py``.

Run by ``blendmatch bench --vs-lmcache PATH`` as a subprocess (LMCache's modules need
stand-ins for torch that must not leak into the benchmark's own process), as
``python bench/lmcache_blend.py SPEC_JSON``; prints one JSON line. Also imported by
``engine.py`` for :func:`workload`, so both sides draw the very same data.

``PATH`` is an unzipped LMCache 0.5.6 wheel (the directory holding ``lmcache/``); the
torch stand-ins come from ``--lmcache-stubs`` (default: ``PATH/../stubs``, the layout of
docs/lmcache.md's setup) and further import directories from ``--lmcache-deps``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

__all__ = ["copies_workload", "planted_queries", "workload"]


def planted_queries(rng: np.random.Generator, chunks: np.ndarray, n: int, length: int, hit_fraction: float,
                    chunk_size: int) -> list[np.ndarray]:
    """``n`` queries of ``length`` tokens; about ``hit_fraction`` of their tokens are rows of
    ``chunks``, placed at random (unaligned) positions among random tokens. The one query
    generator of the benchmarks (``engine.py`` calls it too)."""
    out = []
    n_hits = int(round(hit_fraction * length / chunk_size))
    for _ in range(n):
        q = rng.integers(0, 1 << 31, size=length, dtype=np.uint32)
        if n_hits:
            slots = np.sort(rng.choice(length // chunk_size - 1, size=n_hits, replace=False))
            jitter = rng.integers(0, chunk_size // 2, size=n_hits)
            for s, j in zip(slots, jitter):
                pos = int(s) * chunk_size + int(j)
                q[pos:pos + chunk_size] = chunks[int(rng.integers(0, chunks.shape[0]))]
        out.append(q)
    return out


def workload(chunks: int, chunk_size: int, queries: int, query_tokens: int, hit_fraction: float,
             seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(tokens (chunks, chunk_size), queries)``: random chunks and queries where about
    ``hit_fraction`` of the tokens are stored chunks at random unaligned positions."""
    rng = np.random.default_rng([seed, 99])
    tokens = rng.integers(0, 1 << 31, size=(chunks, chunk_size), dtype=np.uint32)
    return tokens, planted_queries(rng, tokens, queries, query_tokens, hit_fraction, chunk_size)


def copies_workload(copies: int, chunk_size: int, query_tokens: int) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """``(chunk rows, chunk hashes, query)``: one chunk of a repeated token stored under
    ``copies`` chunk hashes (one document after many prefixes), and a query of that token,
    so that every window verifies and each may take one unseen hash (``bench/copies.py``)."""
    rows = np.full((copies, chunk_size), 7, dtype=np.uint32)
    return rows, [i.to_bytes(16, "little") for i in range(copies)], np.full(query_tokens, 7, dtype=np.uint32)


def _run_copies(spec: dict[str, Any]) -> dict[str, Any]:
    import resource

    from lmcache.v1.mp_coordinator.api import BlendNamespace  # noqa: PLC0415 - after the stubs
    from lmcache.v1.mp_coordinator.blend_index import BlendIndex

    rows, hashes, query = copies_workload(spec["copies"], spec["chunk_size"], spec["query_tokens"])
    ns = BlendNamespace("bench-model")
    index = BlendIndex(chunk_size=spec["chunk_size"])
    for row, h in zip(rows, hashes):
        index.add(row, h, 0, ns)
    index.match(query[: 4 * spec["chunk_size"]], ns)  # compile
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    found = index.match(query, ns)
    match_s = time.perf_counter() - t0
    return {"lmcache_match_s": match_s, "lmcache_matches": len(found),
            "lmcache_peak_rss_delta_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) * 1024}


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("shape") == "copies":
        return _run_copies(spec)
    from lmcache.v1.mp_coordinator.api import BlendNamespace  # noqa: PLC0415 - after the stubs
    from lmcache.v1.mp_coordinator.blend_index import BlendIndex

    tokens, qs = workload(spec["chunks"], spec["chunk_size"], spec["queries"], spec["query_tokens"],
                          spec["hit_fraction"], spec["seed"])
    ns = BlendNamespace("bench-model")
    index = BlendIndex(chunk_size=spec["chunk_size"])
    t0 = time.perf_counter()
    for i in range(tokens.shape[0]):
        index.add(tokens[i], i.to_bytes(16, "little"), (i % 64) * spec["chunk_size"], ns)
    ingest_s = time.perf_counter() - t0
    index.match(qs[0], ns)  # compile
    best = float("inf")
    matches = 0
    for _ in range(spec["repeat"]):
        t0 = time.perf_counter()
        found = [index.match(q, ns) for q in qs]
        best = min(best, time.perf_counter() - t0)
        matches = sum(len(f) for f in found)
    windows = sum(len(q) - spec["chunk_size"] + 1 for q in qs)
    return {"lmcache_windows_per_s": windows / best, "lmcache_match_s": best, "lmcache_matches": matches,
            "lmcache_ingest_per_s": tokens.shape[0] / ingest_s, "windows": windows}


if __name__ == "__main__":
    try:
        import lmcache_stub_boot  # noqa: F401 - docs/lmcache.md (k): before any lmcache module
    except ImportError:
        pass
    print(json.dumps(_run(json.loads(sys.argv[1]))), flush=True)
