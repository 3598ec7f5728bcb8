#!/usr/bin/env python
"""Client coalescing benchmark: does merging waiting submits into batch requests pay?

Starts ``blendmatch serve`` in a subprocess on a free loopback port, stores ``--chunks``
chunks through ``POST /events`` (LMCache's wire shape), then drives ``BlendClient``'s drop-in
path the way a busy serving engine does: ``--concurrency`` engine threads in a closed loop,
each ``submit_match`` -> ``wait_match`` -> ``take_match`` -> next. Every query holds
``--matches`` stored chunks among random filler, so every answer is checked.

Configurations (each for ``--duration`` seconds after a short warm-up, same server):

- ``one request per submit``: ``coalesce=False``, LMCache's client behaviour, at
  ``--workers`` workers (LMCache's default 8) and at ``--concurrency`` workers (one round
  trip in flight per engine thread, LMCache's ``--coordinator-blend-match-concurrency 64``).
- ``coalescing``: ``coalesce=True`` at ``--workers`` workers.

Reported: HTTP requests per second and per lookup, lookups/s, latency submit -> answer
(p50/p99), failures. Run: ``python -m blendmatch.bench.client`` (about 40 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from blendmatch.service.client import BlendClient

from .loadtest import spawn_server, stop_server

MODEL = "bench-model"


@dataclass
class Result:
    config: str
    workers: int
    coalesce: bool
    lookups: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    wrong: int
    failed: int

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def store_chunks(url: str, rows: np.ndarray) -> None:
    """POST every row as one stored chunk (LMCache 0.5.6's event batch shape, by hand)."""
    c = rows.shape[1]
    with httpx.Client(base_url=url, timeout=60) as http:
        for seq, lo in enumerate(range(0, len(rows), 500), start=1):
            entries = [{"key": {"chunk_hash_hex": (i + 1).to_bytes(16, "big").hex(), "model_name": MODEL,
                                "kv_rank": (1 << 24) | (1 << 8), "object_group_id": 0, "cache_salt": ""},
                        "size_bytes": 4 * c, "token_ids": rows[i].tolist(), "token_offset": i * c}
                       for i in range(lo, min(lo + 500, len(rows)))]
            batch = {"instance_id": "bench", "incarnation": 0, "seq": seq, "event_type": "store", "tier": "l1",
                     "backend": "LocalCPUBackend", "entries": entries, "shared": False, "ts": 0.0}
            http.post("/events", json={"batches": [batch]}).raise_for_status()


def make_queries(rows: np.ndarray, n: int, tokens: int, matches: int, seed: int) -> list[list[int]]:
    """``n`` queries of ``tokens`` tokens: ``matches`` stored chunks at random chunk-aligned
    slots, random filler (ids above the stored range, so filler never matches) elsewhere."""
    rng = np.random.default_rng(seed)
    c = rows.shape[1]
    out = []
    for _ in range(n):
        q = rng.integers(60_000, 100_000, size=tokens, dtype=np.uint32)
        slots = rng.choice(tokens // c, size=matches, replace=False)
        for slot, row in zip(slots, rng.choice(len(rows), size=matches, replace=False), strict=True):
            q[slot * c:(slot + 1) * c] = rows[row]
        out.append(q.tolist())  # a list, as LMCache's MP server passes
    return out


# ---------------------------------------------------------------------- the load
def drive(url: str, queries: list[list[int]], *, config: str, workers: int, coalesce: bool, concurrency: int,
          duration: float, warmup: float, matches: int, chunk_size: int) -> Result:
    client = BlendClient.maybe_create(url, timeout=5.0, match_concurrency=workers, chunk_size=chunk_size,
                                      coalesce=coalesce)
    assert client is not None
    stop, measuring = threading.Event(), threading.Event()
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    wrong = [0] * concurrency

    def engine(t: int) -> None:
        i = 0
        while not stop.is_set():
            rid = (t, i)
            q = queries[(t * 7919 + i) % len(queries)]
            t0 = time.perf_counter()
            client.submit_match(rid, q, MODEL)
            got = client.wait_match(rid)
            client.take_match(rid)
            if measuring.is_set():
                latencies[t].append(time.perf_counter() - t0)
                wrong[t] += not isinstance(got, list) or len(got) != matches
            i += 1

    threads = [threading.Thread(target=engine, args=(t,), daemon=True) for t in range(concurrency)]
    for th in threads:
        th.start()
    time.sleep(warmup)
    before = client.match_stats()
    measuring.set()
    t0 = time.perf_counter()
    time.sleep(duration)
    measuring.clear()
    seconds = time.perf_counter() - t0
    after = client.match_stats()
    stop.set()
    for th in threads:
        th.join(10)
    client.close()
    lat = np.array([x for per in latencies for x in per]) * 1e3
    return Result(config, workers, coalesce, len(lat), after["requests"] - before["requests"], seconds,
                  float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), sum(wrong),
                  after["failed"] + after["expired"] - before["failed"] - before["expired"])


def table(results: list[Result]) -> str:
    lines = ["| configuration | workers | lookups/s | HTTP requests/s | lookups per request | p50 ms | p99 ms |"
             " wrong / failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.config} | {r.workers} | {r.lookups_per_s:,.0f} | {r.requests_per_s:,.0f} | "
                     f"{r.lookups / max(r.requests, 1):.1f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
                     f"{r.wrong} / {r.failed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--chunks", type=int, default=5000, help="stored chunks")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per query")
    p.add_argument("--matches", type=int, default=4, help="stored chunks per query")
    p.add_argument("--queries", type=int, default=256, help="distinct queries")
    p.add_argument("--concurrency", type=int, default=64, help="engine threads with one submit outstanding each")
    p.add_argument("--workers", type=int, default=8, help="match workers (LMCache's default 8)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds measured per configuration")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--engine", default="cpu")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)

    rows = np.random.default_rng(1).integers(0, 50_000, size=(args.chunks, args.chunk_size), dtype=np.uint32)
    queries = make_queries(rows, args.queries, args.tokens, args.matches, seed=2)
    # the load test's server start (free loopback port, waits for /healthz)
    proc, url = spawn_server(["--chunk-size", str(args.chunk_size), "--engine", args.engine, "--log-level", "warning"])
    try:
        store_chunks(url, rows)
        common = dict(concurrency=args.concurrency, duration=args.duration, warmup=args.warmup,
                      matches=args.matches, chunk_size=args.chunk_size)
        results = [
            drive(url, queries, config="one request per submit", workers=args.workers, coalesce=False, **common),
            drive(url, queries, config="one request per submit", workers=args.concurrency, coalesce=False,
                  **common),
            drive(url, queries, config="coalescing", workers=args.workers, coalesce=True, **common),
        ]
    finally:
        stop_server(proc)
    print(f"{args.concurrency} concurrent submits, {args.tokens}-token queries with {args.matches} matches each, "
          f"{args.chunks} chunks stored, engine {args.engine}, {os.cpu_count()} CPUs (client and server share them)")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"lookups_per_s": r.lookups_per_s, "requests_per_s": r.requests_per_s}
                       for r in results], f, indent=2)
    return 0 if all(r.wrong == 0 and r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
