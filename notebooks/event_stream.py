"""A paced STORE event stream against a blendmatch server (run as a separate process).

    python event_stream.py URL --rate 1000 --batch 50 --seconds 5 --instance nb-stream-1

Sends ``POST /events`` bodies of ``--batch`` STORE entries at ``--rate`` entries per second,
paced by the clock, over one keep-alive connection, until SIGTERM (or SIGINT) arrives or
``--seconds`` (an upper bound) run out; token ids go as JSON lists, the form LMCache's
servers send. Every entry is a new chunk (hash unique to this ``--instance``), so the server
indexes real new content. All bodies for ``--seconds`` are built before the line ``ready``
is printed, so building them costs nothing during the measurement. At the end it prints one
JSON line: entries sent, achieved entries/s, errors, request p50/p99, and whether a signal
(``"stopped_by": "signal"``) or the time bound (``"time"``) ended it.

It runs in its own process so that it shares neither the GIL of an in-process server nor
that of the notebook. Only the standard library and numpy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import sys
import time
from urllib.parse import urlsplit

import numpy as np


def _bodies(instance: str, n_requests: int, batch: int, chunk_size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n_requests):
        rows = rng.integers(0, 50_000, size=(batch, chunk_size), dtype=np.uint32).tolist()
        entries = [{"key": {"chunk_hash_hex": f"{seed & 0xFFFFFFFF:08x}{r * batch + j:024x}",
                            "model_name": "nb-stream", "kv_rank": 1 << 24, "object_group_id": 0,
                            "cache_salt": ""},
                    "size_bytes": 1 << 20, "token_offset": 0, "token_ids": row}
                   for j, row in enumerate(rows)]
        out.append(json.dumps({"batches": [{
            "instance_id": instance, "incarnation": 0, "seq": r + 1, "event_type": "store", "tier": "l1",
            "backend": "LocalCPUBackend", "entries": entries}]}, separators=(",", ":")).encode())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--rate", type=float, required=True, help="STORE entries per second")
    p.add_argument("--batch", type=int, default=50, help="entries per request")
    p.add_argument("--seconds", type=float, required=True, help="upper bound; SIGTERM ends it earlier")
    p.add_argument("--instance", required=True, help="instance_id of the stream (unique per run)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.rate <= 0 or a.batch < 1 or a.seconds <= 0:
        p.error("need --rate > 0, --batch >= 1, --seconds > 0")
    parts = urlsplit(a.url)
    interval = a.batch / a.rate
    n_requests = max(1, int(a.seconds / interval) + 1)
    bodies = _bodies(a.instance, n_requests, a.batch, a.chunk_size, a.seed)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    print("ready", flush=True)
    lat: list[float] = []
    errors = sent = 0
    t_start = time.perf_counter()
    t_end = t_start + a.seconds
    next_at = t_start
    for body in bodies:
        while not stop and next_at > time.perf_counter():  # short sleeps: a signal ends it promptly
            time.sleep(min(0.02, max(0.0, next_at - time.perf_counter())))
        if stop or next_at >= t_end:
            break
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/events", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            errors += resp.status != 200
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        lat.append(time.perf_counter() - t0)
        sent += a.batch
        next_at += interval
    wall = time.perf_counter() - t_start
    conn.close()
    ms = np.asarray(lat) * 1e3
    print(json.dumps({"entries": sent, "requests": len(lat), "seconds": wall, "entries_per_s": sent / wall,
                      "errors": errors, "p50_ms": float(np.percentile(ms, 50)) if lat else None,
                      "p99_ms": float(np.percentile(ms, 99)) if lat else None,
                      "stopped_by": "signal" if stop else "time"}), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
