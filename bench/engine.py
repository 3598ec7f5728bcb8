"""The core benchmark: ingest, filter sharpness, matching throughput and memory, side by side.

Run ``blendmatch bench`` (or ``python -m blendmatch.bench.engine``); ``--help`` lists the
knobs. Defaults finish in well under a minute on 2 cores; ``--chunks 1000000`` is the scale
the targets in docs/performance.md are quoted at.

What it prints (every ratio comes from the same run, since these machines are noisy):
- ingest: chunks/s through ``BlendIndex.add_many`` in batches, growing from empty ("cold":
  includes the first touch of new memory) and into a reserved index ("reserved");
- memory: resident bytes per indexed chunk (the index's own accounting and the process RSS
  delta), tokens included;
- filter: survivors per million no-hit windows for the tagged filter and for the
  identity-free 0/1 filter (``filter="occupancy"``) at the same table and load, and their ratio;
- matching: windows/s of the engine alone and of ``match_batch`` end to end, per batch size
  and hit fraction, the host verification share of the time, and the engine's own phase
  timings (the GPU engine reports upload / kernels / copy-back).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from blendmatch.gpu import ENGINE_NAMES, QueryBatch, select_engine
from blendmatch.index import BlendIndex, BlendNamespace, SlotArray

from .lmcache_blend import planted_queries

__all__ = ["lmcache_side", "main", "run", "run_vs_lmcache"]

NS = BlendNamespace("bench-model")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the peak (an upper bound)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _make_engine(name: str):
    if name == "xp-numpy":
        from blendmatch.gpu.xp_probe import XpEngine

        return XpEngine(xp=np)
    return select_engine(name)


def _time_best(fn, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(chunks: int = 100_000, chunk_size: int = 256, engine: str = "auto", query_tokens: int = 32_768,
        batch_queries: Sequence[int] = (1, 16), hit_fractions: Sequence[float] = (0.0, 0.25),
        ingest_batch: int = 1000, repeat: int = 3, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns the figures it printed (also for ``--json``)."""
    rng = np.random.default_rng(seed)
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    res: dict[str, Any] = {"chunks": chunks, "chunk_size": chunk_size, "query_tokens": query_tokens}
    eng = _make_engine(engine)
    res["engine"], res["engine_reason"] = eng.name, eng.reason
    say(f"engine: {eng.name} ({eng.reason})")

    tokens = rng.integers(0, 1 << 31, size=(chunks, chunk_size), dtype=np.uint32)
    hashes = [i.to_bytes(16, "little") for i in range(chunks)]  # 16-byte hashes, as LMCache's
    offsets = (np.arange(chunks, dtype=np.int64) % 64) * chunk_size

    # -- ingest, cold (growing from empty) and reserved ----------------------------------
    from tqdm import tqdm

    warm = BlendIndex(chunk_size=chunk_size, engine=eng)
    warm.add_many(tokens[:ingest_batch], hashes[:ingest_batch], offsets[:ingest_batch], NS)  # compile
    del warm
    gc.collect()
    rss0 = _rss_bytes()
    idx = BlendIndex(chunk_size=chunk_size, engine=eng)
    t0 = time.perf_counter()
    for s in tqdm(range(0, chunks, ingest_batch), desc="ingest", unit="batch", disable=not progress,
                  leave=False):
        idx.add_many(tokens[s:s + ingest_batch], hashes[s:s + ingest_batch], offsets[s:s + ingest_batch], NS)
    cold = chunks / (time.perf_counter() - t0)
    gc.collect()
    rss_per_chunk = (_rss_bytes() - rss0) / chunks
    mem_per_chunk = idx.memory_bytes() / chunks
    reserved_idx = BlendIndex(chunk_size=chunk_size, engine=eng)
    reserved_idx.reserve(chunks)
    t0 = time.perf_counter()
    for s in range(0, chunks, ingest_batch):
        reserved_idx.add_many(tokens[s:s + ingest_batch], hashes[s:s + ingest_batch],
                              offsets[s:s + ingest_batch], NS)
    reserved = chunks / (time.perf_counter() - t0)
    del reserved_idx
    gc.collect()
    res.update(ingest_cold_per_s=cold, ingest_reserved_per_s=reserved, bytes_per_chunk_index=mem_per_chunk,
               bytes_per_chunk_rss=rss_per_chunk)
    say(f"ingest ({ingest_batch}-chunk batches): cold {cold:,.0f} chunks/s, reserved {reserved:,.0f} chunks/s")
    say(f"memory per chunk (tokens {4 * chunk_size} B included): index accounting {mem_per_chunk:,.0f} B, "
        f"RSS delta {rss_per_chunk:,.0f} B")

    st = idx.stats()
    res["table_size"], res["table_load"] = st["table_size"], st["table_load"]

    # -- filter sharpness on a no-hit workload, same table size and load -----------------
    nohit = planted_queries(rng, tokens, max(batch_queries), query_tokens, 0.0, chunk_size)
    batch = QueryBatch.from_queries(nohit, chunk_size, 1)
    tagged = idx.slots
    occupancy = SlotArray("occupancy")
    live = idx._c["fp"][: idx._c.size][idx._c["occ"][: idx._c.size] >= 0]  # the same fingerprints
    occupancy.rebuild(live, size=tagged.size)
    surv = {}
    for name, table in (("tagged", tagged), ("occupancy", occupancy)):
        cands = eng.probe(batch, table)
        surv[name] = len(cands) / cands.windows * 1e6
    ratio = surv["occupancy"] / max(surv["tagged"], 1e-9)
    res.update(survivors_per_million_tagged=surv["tagged"], survivors_per_million_occupancy=surv["occupancy"],
               filter_ratio=ratio)
    say(f"filter at load {st['table_load']:.4f} (table {st['table_size']:,} slots): survivors per million "
        f"no-hit windows: tagged {surv['tagged']:,.0f}, occupancy (0/1) {surv['occupancy']:,.0f}, "
        f"ratio {ratio:,.1f}x")

    # -- matching throughput ---------------------------------------------------------------
    rows = []
    for hit in hit_fractions:
        qs = planted_queries(rng, tokens, max(batch_queries), query_tokens, hit, chunk_size)
        for bq in batch_queries:
            batch = QueryBatch.from_queries(qs[:bq], chunk_size, 1)
            eng.probe(batch, idx.slots)  # warm-up (compile, device buffers)
            t_eng, cands = _time_best(lambda: eng.probe(batch, idx.slots), repeat)
            work = [(q, NS) for q in qs[:bq]]
            idx.match_batch(work)
            t_all, (results, mst) = _time_best(lambda: idx.match_batch_detailed(work), repeat)
            windows = cands.windows
            row = {
                "hit_fraction": hit, "batch_queries": bq, "windows": windows,
                "engine_windows_per_s": windows / t_eng, "end_to_end_windows_per_s": windows / t_all,
                "survivors": mst.survivors, "matches": mst.matches,
                "verify_share": mst.verify_s / max(mst.engine_s + mst.verify_s, 1e-12),
                "engine_timings": {k: v for k, v in cands.timings.items()},
            }
            rows.append(row)
            phases = "".join(f", {k} {v * 1e3:.2f} ms" for k, v in cands.timings.items())
            say(f"match hit={hit:.0%} batch={bq}x{query_tokens}: engine {row['engine_windows_per_s'] / 1e6:,.1f}M "
                f"windows/s, end-to-end {row['end_to_end_windows_per_s'] / 1e6:,.1f}M windows/s, "
                f"{mst.matches} matches, {mst.survivors} survivors, host verification "
                f"{row['verify_share']:.1%} of the time{phases}")
    res["match"] = rows
    return res


def lmcache_side(wheel: str, spec: dict[str, Any], *, stubs: str | None = None, deps: Sequence[str] = ()
                 ) -> dict[str, Any]:
    """Run ``lmcache_blend.py SPEC`` (LMCache 0.5.6's BlendIndex) in a subprocess with the
    unzipped wheel ``wheel`` and its torch stand-ins on the path; its JSON answer."""
    import subprocess

    wheel_dir = Path(wheel).resolve()
    stubs_dir = Path(stubs) if stubs else wheel_dir.parent / "stubs"
    path = [str(stubs_dir), str(wheel_dir), *[str(d) for d in deps]]
    if not deps and (wheel_dir.parent / "deps").is_dir():
        path.append(str(wheel_dir.parent / "deps"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    script = Path(__file__).with_name("lmcache_blend.py")
    got = subprocess.run([sys.executable, str(script), json.dumps(spec)], env=env, capture_output=True, text=True,
                         cwd=str(stubs_dir.parent), check=False)
    if got.returncode != 0:
        raise RuntimeError(f"LMCache's side failed (rc {got.returncode}):\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def run_vs_lmcache(wheel: str, *, stubs: str | None = None, deps: Sequence[str] = (), chunks: int = 200_000,
                   chunk_size: int = 256, engine: str = "auto", queries: int = 16, query_tokens: int = 32_768,
                   hit_fraction: float = 0.25, repeat: int = 3, seed: int = 0,
                   progress: bool = True) -> dict[str, Any]:
    """``match_batch`` end to end against LMCache 0.5.6's own ``BlendIndex.match`` (one query
    at a time, its only form) on the same chunks and queries (``lmcache_blend.workload``),
    LMCache's side in a subprocess (its torch stand-ins stay out of this process)."""
    from .lmcache_blend import workload

    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    spec = dict(chunks=chunks, chunk_size=chunk_size, queries=queries, query_tokens=query_tokens,
                hit_fraction=hit_fraction, seed=seed, repeat=repeat)
    say(f"vs LMCache: its BlendIndex from {Path(wheel).resolve()}, {chunks:,} chunks, {queries} x {query_tokens} "
        f"tokens, {hit_fraction:.0%} stored content")
    theirs = lmcache_side(wheel, spec, stubs=stubs, deps=deps)

    tokens, qs = workload(chunks, chunk_size, queries, query_tokens, hit_fraction, seed)
    idx = BlendIndex(chunk_size=chunk_size, engine=_make_engine(engine))
    hashes = [i.to_bytes(16, "little") for i in range(chunks)]
    offsets = (np.arange(chunks, dtype=np.int64) % 64) * chunk_size
    for s in range(0, chunks, 1000):
        idx.add_many(tokens[s:s + 1000], hashes[s:s + 1000], offsets[s:s + 1000], NS)
    work = [(q, NS) for q in qs]
    idx.match_batch(work)
    t_all, (results, mst) = _time_best(lambda: idx.match_batch_detailed(work), repeat)
    ours = {"windows_per_s": theirs["windows"] / t_all, "match_s": t_all, "matches": sum(map(len, results)),
            "engine_s": mst.engine_s, "verify_s": mst.verify_s, "survivors": mst.survivors}
    ratio = ours["windows_per_s"] / theirs["lmcache_windows_per_s"]
    res = {"chunks": chunks, "queries": queries, "query_tokens": query_tokens, "hit_fraction": hit_fraction,
           "ours": ours, "lmcache": theirs, "ratio": ratio}
    say(f"vs LMCache: ours {ours['windows_per_s'] / 1e6:,.1f}M windows/s end to end ({ours['matches']} matches; "
        f"engine {mst.engine_s * 1e3:.1f} ms, verification {mst.verify_s * 1e3:.1f} ms), LMCache "
        f"{theirs['lmcache_windows_per_s'] / 1e6:,.1f}M windows/s ({theirs['lmcache_matches']} matches): "
        f"{ratio:.2f}x")
    if ours["matches"] != theirs["lmcache_matches"]:
        say(f"vs LMCache: WARNING the match counts differ ({ours['matches']} vs {theirs['lmcache_matches']})")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="blendmatch bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--chunks", type=int, default=100_000, help="indexed chunks")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--engine", default="auto", choices=[*ENGINE_NAMES, "xp-numpy"])
    p.add_argument("--query-tokens", type=int, default=32_768, help="tokens per query")
    p.add_argument("--batch-queries", default="1,16", help="comma-separated batch sizes (queries) to sweep")
    p.add_argument("--hit-fractions", default="0,0.25", help="comma-separated cached-content fractions")
    p.add_argument("--ingest-batch", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions; the best is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--vs-lmcache", metavar="PATH",
                   help="also run LMCache 0.5.6's BlendIndex on the same chunks and queries (PATH: its unzipped "
                        "wheel; see bench/lmcache_blend.py) and print the end-to-end ratio")
    p.add_argument("--lmcache-stubs", metavar="DIR", help="torch stand-ins for --vs-lmcache (default PATH/../stubs)")
    p.add_argument("--vs-lmcache-only", action="store_true", help="with --vs-lmcache: skip the rest of the bench")
    a = p.parse_args(argv)
    try:
        bqs = [int(x) for x in a.batch_queries.split(",") if x]
        hits = [float(x) for x in a.hit_fractions.split(",") if x]
    except ValueError as exc:
        p.error(f"bad list: {exc}")
    if a.chunks < 1 or a.chunk_size < 1 or a.query_tokens < a.chunk_size * 4 or not bqs or min(bqs) < 1:
        p.error("need --chunks >= 1, --chunk-size >= 1, --query-tokens >= 4 chunks, batch sizes >= 1")
    if any(not 0 <= h <= 0.9 for h in hits):
        p.error("hit fractions must lie in 0..0.9")
    res: dict[str, Any] = {}
    if not (a.vs_lmcache and a.vs_lmcache_only):
        res = run(chunks=a.chunks, chunk_size=a.chunk_size, engine=a.engine, query_tokens=a.query_tokens,
                  batch_queries=bqs, hit_fractions=hits, ingest_batch=a.ingest_batch, repeat=a.repeat,
                  seed=a.seed, progress=not a.quiet)
    if a.vs_lmcache:
        res["vs_lmcache"] = [run_vs_lmcache(a.vs_lmcache, stubs=a.lmcache_stubs, chunks=a.chunks,
                                            chunk_size=a.chunk_size, engine=a.engine, queries=max(bqs),
                                            query_tokens=a.query_tokens, hit_fraction=h, repeat=a.repeat,
                                            seed=a.seed, progress=not a.quiet) for h in hits]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
