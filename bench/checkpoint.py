"""Checkpoint benchmark: ingest pause, lookup latency during a checkpoint, file size, restore.

Question answered: "at 100k and 1M stored 256-token chunks, how long does a
checkpoint pause ingest (target <= 100 ms at 1M), does it pause lookups, how many bytes per
chunk does it take, and how long does a restore take (target <= 10 s at 1M, >= 13x
LMCache 0.5.6's 135 us per key: 20k keys in 2.7 s)?"

What is timed:

- ``pause_ms``: the directory lock held by :func:`~blendmatch.index.checkpoint.capture`
  (the fork; ``inline_pause_ms``: the fallback without fork, encoding and writing under the
  lock, shown for comparison at the smaller sizes only).
- ``write_s``: from the pause to the rename (the child's encoding, CRC-32 and ``fsync``).
- lookups: a thread runs 32-query blend-lookup batches back to back before and during the
  checkpoint; ``lookup_max_ms_*`` / ``lookup_p99_ms_*`` are its batch latencies.
- ``restore_s``: :func:`~blendmatch.index.checkpoint.restore_directory` into a fresh
  directory (every buffer read and CRC-verified, bindings rebuilt); the file was just
  written, so it is read from the page cache (a cold disk adds size / disk bandwidth).
  The restored directory is checked to answer the probe queries as the original did.

Run: ``python -m blendmatch.bench.checkpoint [--chunks 100000 1000000] [--dir PATH] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from blendmatch.index.checkpoint import capture, restore_directory
from blendmatch.index.ckpt_file import read_checkpoint
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import BlendNamespace

from .events import HASH_BYTES, make_requests

#: LMCache 0.5.6 on this machine (docs/performance.md, "Checkpoints"): 20k keys restored in 2.7 s.
LMCACHE_US_PER_KEY = 2.7e6 / 20_000
MODEL = "meta-llama/Llama-3.1-8B"
PER_CALL = 20_000  # chunks generated and applied per make_requests call (bounded memory)


def _directory(chunk_size: int) -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=chunk_size, engine="cpu")
    return d


def build(num_chunks: int, chunk_size: int) -> KeyDirectory:
    d = _directory(chunk_size)
    d.blend_index.reserve(num_chunks)  # type: ignore[union-attr]
    for k, start in enumerate(range(0, num_chunks, PER_CALL)):
        n = min(PER_CALL, num_chunks - start)
        for req in make_requests(n, 1000, chunk_size, seed=k, instance_id=f"bench-{k}", first_hash=start,
                                 packed=True):
            d.apply(req)
    return d


def _probe_queries(d: KeyDirectory, chunk_size: int, n: int = 32) -> list[tuple[np.ndarray, BlendNamespace]]:
    hashes = [(i * 7919).to_bytes(HASH_BYTES, "big") for i in range(n)]
    rows = [t for t in d.get_token_ids(hashes) if t is not None]
    ns = BlendNamespace(MODEL, "", 1)
    rng = np.random.default_rng(1)
    return [(np.concatenate([rng.integers(0, 1000, 100).astype(np.uint32), r,
                             rng.integers(0, 1000, 3 * chunk_size).astype(np.uint32)]), ns) for r in rows]


class _Lookups(threading.Thread):
    def __init__(self, d: KeyDirectory, queries) -> None:
        super().__init__(daemon=True)
        self.d, self.queries = d, queries
        self.stop = threading.Event()
        self.samples: list[tuple[float, float]] = []  # (end time, latency)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.d.blend_index.match_batch(self.queries)
            t1 = time.perf_counter()
            self.samples.append((t1, t1 - t0))


def _lat(samples, lo: float, hi: float) -> dict[str, float]:
    xs = np.array([lat for end, lat in samples if lo <= end <= hi + 0.5]) * 1e3
    if xs.size == 0:
        return {"n": 0}
    return {"n": int(xs.size), "p50_ms": float(np.percentile(xs, 50)), "p99_ms": float(np.percentile(xs, 99)),
            "max_ms": float(xs.max())}


def run(num_chunks: int, chunk_size: int = 256, folder: Optional[str] = None, inline: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    d = build(num_chunks, chunk_size)
    build_s = time.perf_counter() - t0
    queries = _probe_queries(d, chunk_size)
    expected = d.blend_index.match_batch(queries)
    folder = folder or tempfile.mkdtemp(prefix="bm-ckpt-")
    path = os.path.join(folder, f"bench-{num_chunks}.ckpt")
    lookups = _Lookups(d, queries)
    lookups.start()
    time.sleep(1.0)
    base_lo = time.perf_counter() - 1.0
    t_ck = time.perf_counter()
    result = capture(d, path, fork=True)
    t_end = time.perf_counter()
    time.sleep(0.2)
    lookups.stop.set()
    lookups.join()
    out: dict[str, Any] = {
        "chunks": num_chunks, "chunk_size": chunk_size, "build_s": round(build_s, 2),
        "pause_ms": round(result.pause_s * 1e3, 2), "write_s": round(result.total_s, 2),
        "file_bytes": result.bytes, "bytes_per_chunk": round(result.bytes / num_chunks, 1),
        "lookups_before": _lat(lookups.samples, base_lo, t_ck),
        "lookups_during": _lat(lookups.samples, t_ck, t_end),
    }
    if inline:
        r2 = capture(d, path + ".inline", fork=False)
        out["inline_pause_ms"] = round(r2.pause_s * 1e3, 1)
        os.unlink(path + ".inline")
    del d
    fresh = _directory(chunk_size)
    t0 = time.perf_counter()
    with read_checkpoint(path) as ck:
        restore_directory(fresh, ck)
    restore_s = time.perf_counter() - t0
    keys = fresh.stats()["keys"]
    if fresh.blend_index.match_batch(queries) != expected:
        raise AssertionError("the restored directory answers differently")
    out.update({"restore_s": round(restore_s, 2), "restore_us_per_key": round(restore_s / keys * 1e6, 2),
                "vs_lmcache_per_key": round(LMCACHE_US_PER_KEY / (restore_s / keys * 1e6), 1),
                "answers_equal": True})
    os.unlink(path)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    p.add_argument("--inline-below", type=int, default=200_000,
                   help="also time the no-fork fallback for sizes below this (default %(default)s)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = [run(n, args.chunk_size, args.dir, inline=n < args.inline_below) for n in args.chunks]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
