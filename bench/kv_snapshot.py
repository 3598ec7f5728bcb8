"""Snapshot benchmark: what a late router's bootstrap costs (docs/kv-events.md#snapshots).

Question answered: "how long does a snapshot of N chunks take, how many bytes is it, and
what does it do to the live stream's latency meanwhile?" A directory of ``num_chunks``
chunks (256 tokens, one L1 placement each, ``bench/checkpoint.py``'s builder) gets a
publisher attached; a DEALER asks for a snapshot and reads it whole (``snapshot_s``: request
to end frame; ``snapshot_bytes``: payload bytes; ``pages``). Live latency: a thread applies
a STORE of ``live_chunks`` new chunks every ``live_every_s`` and a SUB stamps each message's
arrival; ``live_*_ms`` is apply-to-arrival, measured while no snapshot runs and while one
runs, in the same run (ratios printed). ``fork_pause_s``: how long ingest waited for the
snapshot's fork (the directory lock is held across it). Wall times on a shared machine: compare the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any, Optional, Sequence

import zmq

from blendmatch.bench.checkpoint import build
from blendmatch.bench.events import make_requests
from blendmatch.service.publish import END_SEQ, KVEventsPublisher, KVEventsSettings
from blendmatch.service.publish.follower import SNAPSHOT_SEQ

__all__ = ["run", "main"]


def _snapshot(ctx: zmq.Context, endpoint: str) -> dict[str, Any]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    t0 = time.perf_counter()
    req.send_multipart([b"", SNAPSHOT_SEQ.to_bytes(8, "big")])
    nbytes = pages = 0
    first: Optional[float] = None
    try:
        while True:
            if not req.poll(600_000):
                raise TimeoutError("no snapshot answer")
            frames = req.recv_multipart()
            if first is None:
                first = time.perf_counter() - t0
            if frames[2] == END_SEQ:
                if not frames[3]:
                    raise RuntimeError("snapshot refused")
                break
            pages += 1
            nbytes += len(frames[3])
    finally:
        req.close(0)
    return {"snapshot_s": time.perf_counter() - t0, "first_page_s": first, "snapshot_bytes": nbytes, "pages": pages}


class _Live:
    """STOREs of new chunks on a thread; a SUB stamps their arrival (seq -> time)."""

    def __init__(self, d: Any, ctx: zmq.Context, endpoint: str, chunks: int, every_s: float) -> None:
        self.d, self.chunks, self.every_s = d, chunks, every_s
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.sent: dict[int, float] = {}
        self.got: dict[int, float] = {}
        self.k = 0
        self.pub: Any = None

    def phase(self, seconds: float) -> list[float]:
        """Apply STOREs for ``seconds``; apply-to-arrival latencies (ms)."""
        sent: dict[int, float] = {}
        got: dict[int, float] = {}
        stop = threading.Event()

        def recv() -> None:
            while not stop.is_set() or len(got) < len(sent):
                if self.sub.poll(200):
                    _, seq_b, _ = self.sub.recv_multipart()
                    got[int.from_bytes(seq_b, "big")] = time.perf_counter()
                elif stop.is_set():
                    break

        t = threading.Thread(target=recv)
        t.start()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.k += 1
            req = make_requests(self.chunks, self.chunks, 256, seed=10_000 + self.k, instance_id="live",
                                first_hash=(1 << 40) + self.k * self.chunks, packed=True)[0]
            req["batches"][0]["seq"] = self.k
            seq = self.pub.next_seq
            sent[seq] = time.perf_counter()
            self.d.apply(req)
            time.sleep(self.every_s)
        stop.set()
        t.join()
        return [(got[s] - sent[s]) * 1000 for s in sent if s in got]


def _stats(lat: list[float]) -> dict[str, float]:
    if not lat:
        return {"n": 0}
    lat = sorted(lat)
    return {"n": len(lat), "p50_ms": statistics.median(lat), "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "max_ms": lat[-1]}


def run(num_chunks: int, *, live_chunks: int = 4, live_every_s: float = 0.01, encoding: str = "map") -> dict[str, Any]:
    t0 = time.perf_counter()
    d = build(num_chunks, 256)
    build_s = time.perf_counter() - t0
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                             encoding=encoding))
    pub.start()
    pub.attach_directory(d)
    ctx = zmq.Context()
    try:
        live = _Live(d, ctx, pub.bound_endpoint, live_chunks, live_every_s)
        live.pub = pub
        time.sleep(0.5)  # the slow joiner
        live.phase(0.5)  # warm
        snap: dict[str, Any] = {}
        base = live.phase(3.0)

        def take() -> None:
            snap.update(_snapshot(ctx, pub.bound_replay_endpoint))

        t = threading.Thread(target=take)
        t.start()
        during: list[float] = []
        while t.is_alive():
            during += live.phase(1.0)
        t.join()
        pause = pub.stats()["snapshot_pause_s"]
        quiet = _snapshot(ctx, pub.bound_replay_endpoint)  # the same, with no live load
        out = {"num_chunks": num_chunks, "encoding": encoding, "build_s": build_s, **snap,
               "snapshot_bytes_per_chunk": snap["snapshot_bytes"] / max(1, num_chunks),
               "fork_pause_s": pause, "quiet_snapshot_s": quiet["snapshot_s"],
               "quiet_fork_pause_s": pub.stats()["snapshot_pause_s"], "live_without": _stats(base),
               "live_during": _stats(during)}
        if base and during:
            out["live_p50_ratio"] = out["live_during"]["p50_ms"] / out["live_without"]["p50_ms"]
            out["live_p99_ratio"] = out["live_during"]["p99_ms"] / out["live_without"]["p99_ms"]
        return out
    finally:
        live.sub.close(0)
        pub.stop()
        ctx.destroy(linger=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[100_000])
    ap.add_argument("--encoding", choices=("map", "array"), default="map")
    args = ap.parse_args(argv)
    for n in args.chunks:
        print(json.dumps(run(n, encoding=args.encoding)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
