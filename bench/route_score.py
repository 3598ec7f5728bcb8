"""The routing score's latency against a blend lookup of the same request (docs/performance.md, "Routing score").

``python -m blendmatch.bench.route_score`` starts ``blendmatch serve`` on loopback (CPU
engine), registers ``--instances`` instances and fills it:

- ``--chunks`` chunks stored round-robin by those instances in L1 (fragment material), a
  tenth of them also in a shared L2 pool;
- ``--documents`` sequences of ``--prefix-chunks`` chunks stored under the real
  prefix-chained hashes of the service's token hasher (blake3), so requests that open with
  one get a prefix hit and the score hashes that prefix.

Each query has ``--tokens`` tokens: a stored document first, then never-stored filler with
``--fragments`` stored chunks at unaligned offsets. The same bodies go to ``POST
/directory/blend-lookup`` and to ``POST /route/score`` (no candidates: every live instance)
from ``--clients`` closed-loop clients on keep-alive connections, lookups first, then
scores, then lookups again (the mean of the two lookup runs is the reference, so drift in
the machine's load shows as a gap between them). One table: p50/p99/mean latency and
requests/s of each, and the score / lookup ratio side by side, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from blendmatch.index.token_hasher import TokenHasher
from blendmatch.index.tokens import encode_tokens

from .loadtest import Conn, _post, spawn_server, stop_server

__all__ = ["main"]

MODEL = "route-bench"


def _entry(h: bytes, row: np.ndarray, offset: int) -> dict[str, Any]:
    return {"key": {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": 1 << 24, "object_group_id": 0,
                    "cache_salt": ""}, "size_bytes": 1 << 20, "token_offset": offset, "token_ids": row.tolist()}


def _batch(instance: str, seq: int, entries: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"instance_id": instance, "incarnation": 0, "seq": seq, "event_type": "store", "tier": kw.get("tier", "l1"),
            "backend": kw.get("backend", "LocalCPUBackend"), "shared": kw.get("shared", False), "entries": entries}


def build(args: argparse.Namespace) -> tuple[list[bytes], list[bytes]]:
    """``(event bodies, query bodies)``, deterministic from ``--seed``."""
    c = args.chunk_size
    rng = np.random.default_rng(args.seed)
    rows = rng.integers(0, 50_000, size=(args.chunks, c), dtype=np.uint32)
    docs = rng.integers(0, 50_000, size=(args.documents, args.prefix_chunks * c), dtype=np.uint32)
    hasher = TokenHasher("blake3", c)
    insts = [f"inst-{i}" for i in range(args.instances)]
    seqs = dict.fromkeys(insts + ["pool"], 0)
    bodies: list[bytes] = []

    def add(inst: str, entries: list[dict[str, Any]], **kw: Any) -> None:
        seqs[inst] += 1
        bodies.append(json.dumps({"batches": [_batch(inst, seqs[inst], entries, **kw)]}).encode())

    for start in range(0, args.chunks, 1000):
        inst = insts[(start // 1000) % len(insts)]
        add(inst, [_entry(i.to_bytes(16, "big"), rows[i], (i % 64) * c) for i in range(start, min(args.chunks, start + 1000))])
    add("pool", [_entry(i.to_bytes(16, "big"), rows[i], (i % 64) * c) for i in range(0, args.chunks, 10)],
        tier="l2", backend="mooncake", shared=True)
    for d, doc in enumerate(docs):
        hashes = hasher.chunk_hashes(doc)
        add(insts[d % len(insts)], [_entry(h, doc[k * c:(k + 1) * c], k * c) for k, h in enumerate(hashes)])
    queries = []
    for q in range(args.pool):
        doc = docs[q % len(docs)]
        tail = rng.integers(60_000, 100_000, size=args.tokens - doc.shape[0], dtype=np.uint32)
        slots = rng.choice(tail.shape[0] // (2 * c), size=min(args.fragments, tail.shape[0] // (2 * c)), replace=False)
        for s in slots:
            pos = int(s) * 2 * c + int(rng.integers(0, c))
            tail[pos:pos + c] = rows[int(rng.integers(args.chunks))]
        tokens = np.concatenate([doc, tail])
        queries.append(json.dumps({"tokens_b64": encode_tokens(tokens), "model_name": MODEL}).encode())
    return bodies, queries


async def _drive(port: int, path: str, bodies: list[bytes], clients: int, per_client: int) -> tuple[list[float], float]:
    """Closed loop: ``clients`` connections, ``per_client`` requests each -> (latencies, wall s)."""
    lat: list[float] = []

    async def one(k: int) -> None:
        conn = await Conn("127.0.0.1", port).open()
        try:
            for i in range(per_client):
                raw = _post("127.0.0.1", path, bodies[(k * per_client + i) % len(bodies)])
                t0 = time.perf_counter()
                status, body = await conn.request(raw)
                lat.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"{path}: {status} {body[:200]!r}")
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(clients)))
    return lat, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e3


async def run(args: argparse.Namespace, port: int, queries: list[bytes]) -> list[str]:
    lines = [f"{'clients':>7} {'endpoint':<12} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'req/s':>8}   "
             f"{'score/lookup p50':>16} {'p99':>6} {'mean':>6}"]
    for clients in args.clients:
        per = max(1, args.requests // clients)
        await _drive(port, "/route/score", queries, clients, min(per, 20))  # warm both paths
        await _drive(port, "/directory/blend-lookup", queries, clients, min(per, 20))
        runs = {}
        for name, path in (("lookup", "/directory/blend-lookup"), ("score", "/route/score"),
                           ("lookup2", "/directory/blend-lookup")):
            runs[name] = await _drive(port, path, queries, clients, per)
        lookup_lat = runs["lookup"][0] + runs["lookup2"][0]
        lookup_wall = runs["lookup"][1] + runs["lookup2"][1]
        score_lat, score_wall = runs["score"]
        ratios = [_pct(score_lat, 50) / _pct(lookup_lat, 50), _pct(score_lat, 99) / _pct(lookup_lat, 99),
                  statistics.fmean(score_lat) / statistics.fmean(lookup_lat)]
        for name, lat, wall in (("lookup", lookup_lat, lookup_wall), ("score", score_lat, score_wall)):
            tail = "   " + f"{ratios[0]:>16.2f} {ratios[1]:>6.2f} {ratios[2]:>6.2f}" if name == "score" else ""
            lines.append(f"{clients:>7} {name:<12} {_pct(lat, 50):>8.3f} {_pct(lat, 99):>8.3f} "
                         f"{statistics.fmean(lat) * 1e3:>8.3f} {len(lat) / wall:>8.0f}{tail}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.route_score", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=20_000)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--prefix-chunks", type=int, default=8)
    p.add_argument("--fragments", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--pool", type=int, default=32, help="distinct queries, rotated")
    p.add_argument("--requests", type=int, default=400, help="requests per endpoint and client count")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens < args.prefix_chunks * args.chunk_size + 2 * args.chunk_size:
        print("--tokens must leave room after the document (prefix-chunks * chunk-size + 2 chunks)", file=sys.stderr)
        return 2
    events, queries = build(args)
    log = os.path.join(tempfile.gettempdir(), f"blendmatch-route-bench-{os.getpid()}.log")
    proc, url = spawn_server(["--engine", "cpu", "--chunk-size", str(args.chunk_size)], log_path=log)
    port = int(url.rsplit(":", 1)[1])
    try:
        async def prepare() -> None:
            conn = await Conn("127.0.0.1", port).open()
            for i in range(args.instances):
                body = json.dumps({"instance_id": f"inst-{i}", "ip": "127.0.0.1", "http_port": 1}).encode()
                assert (await conn.request(_post("127.0.0.1", "/instances", body)))[0] == 200
            for body in events:
                status, text = await conn.request(_post("127.0.0.1", "/events", body))
                if status != 200:
                    raise RuntimeError(f"fill: {status} {text[:300]!r}")
            status, text = await conn.request(_post("127.0.0.1", "/route/score", queries[0]))
            print(f"one score: {text.decode()[:400]}")
            await conn.close()

        asyncio.run(prepare())
        load_before = os.getloadavg()
        lines = asyncio.run(run(args, port, queries))
        load_after = os.getloadavg()
    finally:
        stop_server(proc)
    print(f"route score vs blend lookup: {args.chunks} chunks + {args.documents} documents of {args.prefix_chunks} "
          f"chunks, {args.instances} live instances, {args.tokens}-token queries (a {args.prefix_chunks}-chunk "
          f"prefix hit + {args.fragments} fragments), CPU engine, {os.cpu_count()} CPUs")
    print(f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
