"""One chunk stored under many chunk hashes, and a long query of it: the per-position rule's worst case.

Run ``python -m blendmatch.bench.copies`` (``--help`` lists the knobs). The same content
under many chunk hashes is the normal CacheBlend case (one document after many prefixes);
a query made of that content verifies at every window, and each window may take one hash
the query has not taken yet. Before the current rule, with 1,000 copies and a 10,000-token
query this took 6.4 s and 1.7 GB when verification walked every (position, occupant) pair
under the index lock. Prints our time and peak-RSS growth, and with ``--vs-lmcache PATH`` LMCache 0.5.6's
own ``BlendIndex`` on the same shape in the same run (its side in a subprocess, as
``blendmatch bench --vs-lmcache``). Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any, Sequence

from blendmatch.index import BlendIndex, BlendNamespace

from .engine import lmcache_side
from .lmcache_blend import copies_workload

__all__ = ["main", "run"]


def run(copies: int = 1000, query_tokens: int = 10_000, chunk_size: int = 16, engine: str = "cpu") -> dict[str, Any]:
    """Our side: ``match`` of the query against ``copies`` copies (seconds, matches, peak RSS
    growth during the match)."""
    rows, hashes, query = copies_workload(copies, chunk_size, query_tokens)
    ns = BlendNamespace("bench-model")
    idx = BlendIndex(chunk_size=chunk_size, engine=engine)
    idx.add_many(rows, hashes, [0] * copies, ns)
    idx.match(query[: 4 * chunk_size], ns)  # compile / warm
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    found, stats = idx.match_batch_detailed([(query, ns)])
    match_s = time.perf_counter() - t0
    return {"copies": copies, "query_tokens": query_tokens, "chunk_size": chunk_size, "match_s": match_s,
            "matches": len(found[0]), "occupant_steps": stats.occupant_steps,
            "peak_rss_delta_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) * 1024}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.copies", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--copies", type=int, default=1000, help="chunk hashes stored with the same content")
    p.add_argument("--query-tokens", type=int, default=10_000)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--engine", default="cpu")
    p.add_argument("--vs-lmcache", metavar="PATH", help="also run LMCache 0.5.6's BlendIndex (PATH: its unzipped wheel)")
    p.add_argument("--lmcache-stubs", metavar="DIR", help="torch stand-ins for --vs-lmcache (default PATH/../stubs)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    a = p.parse_args(argv)
    if a.copies < 1 or a.chunk_size < 1 or a.query_tokens < 4 * a.chunk_size:
        p.error("need --copies >= 1, --chunk-size >= 1, --query-tokens >= 4 chunks")
    res = run(a.copies, a.query_tokens, a.chunk_size, a.engine)
    print(f"ours: {res['copies']:,} copies, {res['query_tokens']:,}-token query: {res['match_s'] * 1e3:,.1f} ms, "
          f"{res['matches']} matches, peak RSS +{res['peak_rss_delta_bytes'] / 2**20:,.1f} MiB", flush=True)
    if a.vs_lmcache:
        theirs = lmcache_side(a.vs_lmcache, {"shape": "copies", "copies": a.copies, "chunk_size": a.chunk_size,
                                             "query_tokens": a.query_tokens}, stubs=a.lmcache_stubs)
        res["lmcache"] = theirs
        print(f"LMCache 0.5.6: {theirs['lmcache_match_s'] * 1e3:,.1f} ms, {theirs['lmcache_matches']} matches, "
              f"peak RSS +{theirs['lmcache_peak_rss_delta_bytes'] / 2**20:,.1f} MiB", flush=True)
        if theirs["lmcache_matches"] != res["matches"]:
            print(f"WARNING: the match counts differ ({res['matches']} vs {theirs['lmcache_matches']})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
