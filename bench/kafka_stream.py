"""A steady stream of LMCache cache events into a Kafka topic (``python -m blendmatch.bench.kafka_stream``).

Question answered: "what does a running LMCache fleet look like to the replicas?", for a
local fleet (``deploy/compose/``) or a smoke test of a deployment, without GPUs or vLLM.
It writes what LMCache 0.5.6's ``KafkaCacheEventSink`` writes: key = the instance id, value =
``{"batches":[batch]}`` with one STORE batch of ``--entries`` new 256-token chunks (every
field, ``token_ids`` as JSON lists), ``--instances`` instances taking turns, each with its own
``seq`` from 1. Records are paced to ``--rate`` entries/s (0: as fast as the broker takes
them) until ``--records`` were written (0: until SIGTERM/SIGINT), then it flushes and exits 0.

A fraction ``--repeat`` of the entries store content seen before under a new hash (a
document reused in another prompt), so blend lookups over the stream have something to
find. One progress line to stderr every ``--report-every`` seconds. Needs the ``kafka``
extra (confluent-kafka).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Iterator, Optional, Sequence

import numpy as np

__all__ = ["build_parser", "main", "records"]


def records(*, entries: int, instances: int, chunk_size: int, model: str, repeat: float,
            seed: int) -> Iterator[tuple[bytes, bytes]]:
    """Endless LMCache-form records ``(key, value)``: instance ``mp-<i>`` in turn, seq 1, 2, ...
    per instance, chunk hashes ``<stream seed><n>`` never repeated within a stream."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 150_000, size=(64, chunk_size), dtype=np.uint32)  # the reused "documents"
    seqs = [0] * instances
    n = 0
    r = 0
    while True:
        i = r % instances
        seqs[i] += 1
        ents = []
        for j in range(entries):
            if rng.random() < repeat:
                tokens = pool[rng.integers(0, len(pool))]
            else:
                tokens = rng.integers(0, 150_000, size=chunk_size, dtype=np.uint32)
            ents.append({"key": {"chunk_hash_hex": ((seed << 64) | n).to_bytes(16, "big").hex(), "model_name": model,
                                 "kv_rank": 1 << 24, "object_group_id": 0, "cache_salt": ""},
                         "size_bytes": 1 << 20, "token_ids": tokens.tolist(), "token_offset": j * chunk_size})
            n += 1
        batch = {"instance_id": f"mp-{i}", "incarnation": 1, "seq": seqs[i], "event_type": "store", "tier": "l1",
                 "backend": "LocalCPUBackend", "entries": ents, "shared": False, "ts": time.time(),
                 "capacity_bytes": 0, "capacity_revision": 0}
        yield f"mp-{i}".encode(), json.dumps({"batches": [batch]}, separators=(",", ":")).encode()
        r += 1


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_deploy.py parses the compose file's generator command with it)."""
    ap = argparse.ArgumentParser(prog="python -m blendmatch.bench.kafka_stream", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True, help="Kafka brokers, host:port[,host:port]")
    ap.add_argument("--topic", default="lmcache-cache-events", help="default %(default)s (LMCache's)")
    ap.add_argument("--rate", type=float, default=500.0, help="entries/s; 0 = as fast as possible (default %(default)s)")
    ap.add_argument("--entries", type=int, default=25, help="entries per record, as LMCache's sink (default %(default)s)")
    ap.add_argument("--instances", type=int, default=4, help="MP server instances taking turns (default %(default)s)")
    ap.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default %(default)s)")
    ap.add_argument("--model", default="demo-model", help="model_name of the keys (default %(default)s)")
    ap.add_argument("--repeat", type=float, default=0.2, help="fraction of entries reusing earlier content")
    ap.add_argument("--records", type=int, default=0, help="stop after this many records (0: run until stopped)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-every", type=float, default=10.0, help="seconds between progress lines")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("entries", "instances", "chunk_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rate < 0 or args.records < 0 or not 0.0 <= args.repeat <= 1.0:
        ap.error("--rate and --records must be >= 0 and --repeat in 0..1")
    try:
        from confluent_kafka import KafkaException, Producer
    except ImportError:
        ap.error("needs confluent-kafka: pip install 'blendmatch[kafka]'")

    stop = False

    def _stop(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    producer = Producer({"bootstrap.servers": args.bootstrap, "enable.idempotence": True, "acks": "all",
                         "linger.ms": 5, "message.max.bytes": 16 << 20})
    failed: list[str] = []

    def _delivered(err, msg) -> None:  # noqa: ANN001 - confluent-kafka's callback signature
        if err is not None:
            failed.append(str(err))

    gen = records(entries=args.entries, instances=args.instances, chunk_size=args.chunk_size, model=args.model,
                  repeat=args.repeat, seed=args.seed)
    t0 = last = time.monotonic()
    sent = 0
    while not stop and (args.records == 0 or sent < args.records) and not failed:
        key, value = next(gen)
        while True:
            try:
                producer.produce(args.topic, key=key, value=value, on_delivery=_delivered)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.05)
            except KafkaException as exc:
                failed.append(str(exc))
                break
        sent += 1
        producer.poll(0)
        now = time.monotonic()
        if args.rate > 0:  # pace: record k is due at k * entries / rate seconds
            due = t0 + sent * args.entries / args.rate
            if due > now:
                time.sleep(due - now)
        if now - last >= args.report_every:
            print(f"kafka_stream: {sent} records, {sent * args.entries} entries to {args.topic} "
                  f"({sent * args.entries / (now - t0):.0f} entries/s)", file=sys.stderr, flush=True)
            last = now
    left = producer.flush(30)
    if failed or left:
        print(f"kafka_stream: {len(failed)} records failed ({failed[:1]}), {left} not delivered", file=sys.stderr)
        return 1
    print(f"kafka_stream: done, {sent} records, {sent * args.entries} entries", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
