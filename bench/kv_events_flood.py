"""KV-events replay flood: live publish latency and memory while replay clients never read.

Question answered: "what does a replay flood cost the live stream and the process?"
(Before the byte budgets, twenty DEALERs asking for the whole ring and never reading took
a server from 253 MB to 9 GB and live latency from 4 ms to 2.9 s: docs/kv-events.md.)

What is measured, in one process: a publisher (``service/publish``) whose ring is filled
with ``--messages`` messages of ``--chunks`` 256-token chunks (~1 KB each on the wire,
under pyzmq's 64 KB copy threshold at the default 36); a SUB subscriber timing a small
message sunk every 20 ms, from ``sink`` to receipt, first with no replay client
(``base_*``), then while ``--clients`` DEALERs each send ``--requests`` "replay from seq 0"
and never read (``flood_*``: median, p99, max); the process's resident set before, during
the flood and 1 s after the clients left; and the publisher's byte gauges (when it has
them). The DEALERs take one message at most off the wire (receive high-water mark 1, a
4 KB kernel buffer), so their side does not count.

``--publisher MODULE`` imports ``KVEventsPublisher`` and ``KVEventsSettings`` from another
module (e.g. a copy of an older ``service/publish`` on ``PYTHONPATH``) for an A/B run;
settings it does not know are left out. Run each variant in its own process, alternating.

Run: ``python -m blendmatch.bench.kv_events_flood [--messages 300] [--chunks 36]
[--clients 10] [--requests 5] [--publisher MODULE]``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from blendmatch.index.holders import HolderChanges, Spot, StoredChunks

TOKENS = 256


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _changes(k: int, chunks: int) -> HolderChanges:
    rng = np.random.default_rng(k)
    tokens = rng.integers(256, 60_000, size=(chunks, TOKENS), dtype=np.uint32)
    hashes = [k.to_bytes(8, "big") + j.to_bytes(8, "big") for j in range(chunks)]
    spot = Spot("gpu-a", "llama", "l1", "cpu", False)
    return HolderChanges(1_700_000_000.0 + k, None, {}, {}, {spot: StoredChunks(hashes, tokens)}, 0)


def _quantile(xs: list[float], q: float) -> Optional[float]:
    return round(sorted(xs)[int(q * (len(xs) - 1))] * 1000, 2) if xs else None


def run(messages: int, chunks: int, clients: int, requests: int, module: str) -> dict[str, Any]:
    import zmq

    mod = importlib.import_module(module)
    known = {f.name for f in dataclasses.fields(mod.KVEventsSettings)}
    settings = {k: v for k, v in {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}.items()
                if k in known}
    pub = mod.KVEventsPublisher(mod.KVEventsSettings(**settings))
    pub.start()
    ctx = zmq.Context()
    try:
        for k in range(messages):
            pub.sink(_changes(k, chunks))
        pub.wait_idle(120)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.bound_endpoint)
        time.sleep(0.5)  # the slow joiner
        sent: dict[int, float] = {}
        lat: list[float] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                if sub.poll(100):
                    seq = int.from_bytes(sub.recv_multipart()[1], "big")
                    if seq in sent:
                        lat.append(time.perf_counter() - sent[seq])

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()

        def phase(n: int) -> list[float]:
            del lat[:]
            for _ in range(n):
                sent[pub.next_seq] = time.perf_counter()
                pub.sink(_changes(1_000_000 + pub.next_seq, 2))
                time.sleep(0.02)
            time.sleep(0.5)
            return list(lat)

        rss_before = _rss_mb()
        base = phase(100)
        socks = []
        for _ in range(clients):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 4096)
            d.connect(pub.bound_replay_endpoint)
            for _ in range(requests):
                d.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(d)
        flood = phase(100)
        rss_flood = _rss_mb()
        held = pub.held_bytes() if hasattr(pub, "held_bytes") else None
        for d in socks:
            d.close(0)
        time.sleep(1.0)
        rss_after = _rss_mb()
        stop.set()
        thread.join()
        sub.close(0)
        return {"publisher": module, "messages": messages, "chunks": chunks, "clients": clients, "requests": requests,
                "ring_bytes": sum(len(p) for _, _, p in pub._buffer),
                "base_p50_ms": _quantile(base, 0.5), "base_max_ms": _quantile(base, 1.0),
                "flood_p50_ms": _quantile(flood, 0.5), "flood_p99_ms": _quantile(flood, 0.99),
                "flood_max_ms": _quantile(flood, 1.0), "received": [len(base), len(flood)],
                "rss_before_mb": round(rss_before), "rss_flood_mb": round(rss_flood),
                "rss_after_leave_mb": round(rss_after), "held_bytes_flood": held}
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blendmatch.bench.kv_events_flood", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=36, help="chunks per ring message (~1 KB each)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--requests", type=int, default=5, help="replay requests per client")
    parser.add_argument("--publisher", default="blendmatch.service.publish")
    a = parser.parse_args(argv)
    print(json.dumps(run(a.messages, a.chunks, a.clients, a.requests, a.publisher)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
