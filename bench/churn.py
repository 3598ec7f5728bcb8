"""Churn benchmark: an instance that evicts as it stores, through the key directory.

Question answered: "what does the directory's per-instance L1 bookkeeping cost when an
instance keeps a steady number of L1 chunks while it stores new ones and deletes old ones
(an LRU cache at capacity), and how far past its live keys does the L1 log grow?"
(``index/bindings.py``: each instance's L1 chunks are an append-only log, filtered when
read and compacted when a lost copy leaves it over twice the keys plus a slack.)

One instance stores ``--keys`` L1 keys (``--batch`` entries a STORE, no tokens: the
directory's bookkeeping, not the index), then runs ``--rounds`` rounds of one DELETE of its
``--batch`` oldest keys and one STORE of as many new ones, in process, with
``KeyDirectory.apply``. Printed: the churn's entries (deletes plus stores) per second of
wall and of CPU; the time spent compacting logs (``BindingStore.l1_chunks_of`` timed by a
wrapper), as a share of the churn; the log's longest length against the live keys; and one
fence of the instance at the end (it walks the log). Each figure comes from one run; run it
beside another tree to compare (``PYTHONPATH``), alternating, as this machine is noisy.

Run: ``python -m blendmatch.bench.churn [--keys 100000] [--rounds 300] [--batch 1000]
[--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.wire_models import wire_batch, wire_entry

__all__ = ["measure", "main"]


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def measure(keys: int = 100_000, rounds: int = 300, batch: int = 1000) -> dict[str, Any]:
    """One run (module docstring); the figures as a dict."""
    d = KeyDirectory()
    store = d._store  # the bench looks inside on purpose: the log is what it measures
    seq = 0

    def send(kind: str, ids: range) -> None:
        nonlocal seq
        seq += 1
        counts = d.apply({"batches": [wire_batch("a", seq, kind, [wire_entry(_key(i), "m") for i in ids])]})
        if counts.applied != 1:
            raise RuntimeError(f"batch {seq} was not applied: {counts}")

    for lo in range(0, keys, batch):
        send("store", range(lo, min(keys, lo + batch)))
    compacting = [0.0, 0]
    longest = len(store.l1_log.get("a", ()))
    filtered = store.l1_chunks_of

    def timed(inst: str) -> list[bytes]:
        t = time.perf_counter()
        try:
            return filtered(inst)
        finally:
            compacting[0] += time.perf_counter() - t
            compacting[1] += 1

    store.l1_chunks_of = timed  # type: ignore[method-assign]
    oldest, newest = 0, keys
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        send("delete", range(oldest, oldest + batch))
        oldest += batch
        send("store", range(newest, newest + batch))
        newest += batch
        longest = max(longest, len(store.l1_log.get("a", ())))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    store.l1_chunks_of = filtered  # type: ignore[method-assign]
    live = store.l1_keys.get("a", 0)
    if live != keys:
        raise RuntimeError(f"{live} L1 keys after the churn, expected {keys}")
    t = time.perf_counter()
    fenced = d.fence_instance("a")
    fence_s = time.perf_counter() - t
    if fenced.keys != keys:
        raise RuntimeError(f"the fence dropped {fenced.keys} keys, expected {keys}")
    entries = 2 * rounds * batch
    return {"keys": keys, "rounds": rounds, "batch": batch, "churn_entries": entries,
            "churn_s": round(wall, 4), "entries_per_s": round(entries / wall, 1),
            "entries_per_cpu_s": round(entries / cpu, 1) if cpu > 0 else None,
            "compactions": compacting[1], "compaction_s": round(compacting[0], 4),
            "compaction_share": round(compacting[0] / wall, 4),
            "longest_log": longest, "longest_log_per_key": round(longest / keys, 3),
            "fence_s": round(fence_s, 4)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blendmatch.bench.churn",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000, help="live L1 keys of the instance")
    parser.add_argument("--rounds", type=int, default=300, help="rounds of one DELETE and one STORE")
    parser.add_argument("--batch", type=int, default=1000, help="entries a DELETE or STORE")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for name in ("keys", "rounds", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.keys < args.batch:
        parser.error("--keys must be >= --batch (each round deletes --batch of the oldest keys)")
    r = measure(args.keys, args.rounds, args.batch)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"one instance, {r['keys']:,} L1 keys, {r['rounds']} rounds of {r['batch']:,} deletes + "
          f"{r['batch']:,} stores:")
    print(f"  churn: {r['entries_per_s']:,.0f} entries/s ({r['entries_per_cpu_s']:,.0f} per CPU-s), "
          f"{r['churn_s']:.2f} s")
    print(f"  log compactions: {r['compactions']}, {r['compaction_s'] * 1e3:.0f} ms "
          f"({100 * r['compaction_share']:.1f}% of the churn)")
    print(f"  longest L1 log: {r['longest_log']:,} entries ({r['longest_log_per_key']:.2f} per live key)")
    print(f"  fence of the instance at the end: {r['fence_s'] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
