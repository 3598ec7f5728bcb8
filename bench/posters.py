"""Event bodies and event posters of ``blendmatch loadtest``, and the summary table of the service's targets.

- :func:`entry_text` / :func:`events_body`: LMCache's ``POST /events`` JSON (STORE batches,
  ``token_ids`` as JSON lists), the one formatter of the fill, the paced stream and the
  posters.
- :class:`StoreBodies`: fresh STORE bodies without per-token work in the generator: each
  entry is a unique first token id plus one of 1,024 pre-formatted random tails (formatting
  256 ids per entry in Python cost ~50 us, a quarter of a core at 5,000 entries/s, taken
  from the server being measured), joined from pre-encoded parts.
- :func:`post_loop`: ``posters`` connections posting ``batch``-entry bodies back to back
  (closed loop) for ``duration`` seconds: the ingest rate one server sustains.
- :func:`issue_table`: every figure of the service's targets table from one run's phases, with the
  batch sizes and poster counts, against its targets.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Sequence

import numpy as np

from .loadgen import Conn, percentile_ms, post_request

__all__ = ["MODEL", "StoreBodies", "entry_text", "events_body", "issue_table", "post_loop"]

MODEL = "loadtest-model"


def entry_text(i: int, token_text: str, offset: int, model: str = MODEL) -> str:
    """One STORE entry (LMCache's JSON) with chunk hash ``i`` and ``token_ids`` ``[token_text]``."""
    return ('{"key":{"chunk_hash_hex":"%032x","model_name":"%s","kv_rank":16777216,"object_group_id":0,'
            '"cache_salt":""},"size_bytes":1048576,"token_offset":%d,"token_ids":[%s]}'
            % (i & ((1 << 128) - 1), model, offset, token_text))


def events_body(instance: str, seq: int, entries: list[str]) -> bytes:
    return ('{"batches":[{"instance_id":"%s","incarnation":0,"seq":%d,"event_type":"store","tier":"l1",'
            '"backend":"LocalCPUBackend","entries":[%s]}]}' % (instance, seq, ",".join(entries))).encode()


class StoreBodies:
    """Successive ``POST /events`` requests of one instance: ``batch`` new chunks each (new
    hashes, new content), in order (``seq`` 1, 2, ...). The bytes are those of
    :func:`events_body` over :func:`entry_text` (``tests/test_bench_loadtest.py`` compares
    them), joined once from pre-encoded parts: 0.8 us per entry of the posters' CPU at
    64-entry bodies instead of 1.8 with the string formatter (3.0 against 5.5 at 1,000),
    which the server being measured shares the machine with."""

    def __init__(self, host: str, instance: str, chunk_size: int, first_id: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.tails = [",".join(map(str, row.tolist())) for row in
                      rng.integers(0, 50_000, size=(1024, chunk_size - 1), dtype=np.uint32)]
        self._tail_bytes = [("," + tail + "]}").encode() for tail in self.tails]  # ids 2.. of an entry, closed
        self._mid = ('","model_name":"%s","kv_rank":16777216,"object_group_id":0,"cache_salt":""},'
                     '"size_bytes":1048576,"token_offset":0,"token_ids":[' % MODEL).encode()
        self.host, self.instance, self.next_id, self.seq = host, instance, first_id, 1

    def next(self, batch: int) -> bytes:
        i, tails, mid = self.next_id, self._tail_bytes, self._mid
        parts = [b'{"batches":[{"instance_id":"%s","incarnation":0,"seq":%d,"event_type":"store","tier":"l1",'
                 b'"backend":"LocalCPUBackend","entries":[' % (self.instance.encode(), self.seq)]
        opening = b'{"key":{"chunk_hash_hex":"'
        for n in range(i, i + batch):  # entry_text(n, "<n % 4e9>,<tail>", 0), comma-separated
            parts += (opening, b"%032x" % (n & _HASH_MASK), mid, b"%d" % (n % 4_000_000_000), tails[n % 1024])
            opening = b',{"key":{"chunk_hash_hex":"'
        parts.append(b"]}]}")
        self.next_id += batch
        self.seq += 1
        return post_request(self.host, "/events", b"".join(parts))


_HASH_MASK = (1 << 128) - 1


async def post_loop(host: str, port: int, *, posters: int, batch: int, duration: float, chunk_size: int,
                    first_id: int) -> dict[str, Any]:
    """``posters`` connections, each its own instance posting ``batch``-entry STORE bodies
    back to back for ``duration`` s. Returns entries, posts, errors, wall seconds, latencies
    and the generator's own CPU seconds (it shares the machine with the server)."""
    makers = [StoreBodies(f"{host}:{port}", f"loadtest-poster-{first_id >> 40}-{k}", chunk_size,
                          first_id + k * (1 << 36), seed=k) for k in range(posters)]
    conns = [await Conn(host, port).open() for _ in range(posters)]
    lat: list[float] = []
    counts = {"entries": 0, "posts": 0, "errors": 0}
    t_end = time.perf_counter() + duration

    async def one(k: int) -> None:
        while time.perf_counter() < t_end:
            raw = makers[k].next(batch)
            t0 = time.perf_counter()
            try:
                status, _ = await conns[k].request(raw)
            except (OSError, asyncio.IncompleteReadError, RuntimeError):
                counts["errors"] += 1
                await conns[k].close()
                continue
            lat.append(time.perf_counter() - t0)
            counts["posts"] += 1
            if status == 200:
                counts["entries"] += batch
            else:
                counts["errors"] += 1

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(posters)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for c in conns:
        await c.close()
    return {**counts, "seconds": wall, "p50_ms": percentile_ms(lat, 50), "p99_ms": percentile_ms(lat, 99),
            "max_ms": percentile_ms(lat, 100), "generator_cpu_s": cpu}


# -------------------------------------------------------------- the service's targets table
#: (figure, target, higher is better)
TARGETS = {
    "ratio": (10.0, True), "p99_idle": (8.0, False), "p99_stream": (12.0, False),
    "ingest_64": (150_000.0, True), "ingest_1000": (250_000.0, True),
}


def _verdict(key: str, value: float | None) -> str:
    if value is None:
        return "not measured"
    target, up = TARGETS[key]
    return "**met**" if (value >= target if up else value <= target) else "missed"


def issue_table(results: Sequence[Any], *, config: str, lmcache: str | None, event_rate: float, event_batch: int,
                posters: int, ingest_batches: Sequence[int]) -> str:
    """The service's targets table (its rows, in its order) from ``PhaseResult`` rows: ours from
    ``config``, LMCache's from ``lmcache`` (its config name), ingest from the
    ``events BxP`` phases. Every row is printed; one not measured in this run says so. An
    ingest row also gives the CPU per entry of the server and of the posters (which share
    the machine) and the cores the machine left idle: idle cores with a missed rate say
    that a serial stage of the server, not the machine, set it."""
    by = {(r.config, r.phase): r for r in results}
    ours, theirs = by.get((config, "lookup")), by.get((lmcache, "lookup")) if lmcache else None
    stream = by.get((config, "lookup+events"))
    rows = ["| figure | measured | target | met? |", "|---|---|---|---|"]
    ratio = ours.rps / theirs.rps if ours and theirs and theirs.rps else None
    gen = ours.generator if ours else "-"
    rows.append(f"| lookups/s, one process, vs LMCache 0.5.6's coordinator in the same run ({gen}, "
                f"{ours.clients if ours else '-'} clients) | "
                + (f"{ours.rps:,.0f} vs {theirs.rps:,.0f}: **{ratio:.1f}x**" if ratio else
                   f"{ours.rps:,.0f} (LMCache not run: --vs-lmcache SITE)" if ours else "-")
                + f" | >= 10x | {_verdict('ratio', ratio)} |")
    rows.append(f"| lookup p99, {ours.clients if ours else '-'} clients, idle ingest | "
                + (f"{ours.p99_ms:.1f} ms (p99.9 {ours.p999_ms:.1f})" if ours else "-")
                + f" | <= 8 ms | {_verdict('p99_idle', ours.p99_ms if ours else None)} |")
    rows.append(f"| lookup p99 while one poster streams {event_rate:,.0f} STORE entries/s (JSON token_ids, "
                f"{event_batch}-entry batches) | "
                + (f"{stream.p99_ms:.1f} ms at {stream.event_entries_per_s:,.0f} entries/s achieved, "
                   f"{stream.rps:,.0f} lookups/s" if stream else "-")
                + f" | <= 12 ms | {_verdict('p99_stream', stream.p99_ms if stream else None)} |")
    for b in ingest_batches:
        r = by.get((config, f"events {b}x{posters}"))
        key = "ingest_64" if b <= 64 else "ingest_1000"
        cpu = (f", {r.server_cpu_us_per_req / b:.1f} us server CPU/entry"
               if r is not None and r.server_cpu_us_per_req is not None else "")
        if r is not None and r.generator_cpu_us_per_entry is not None:  # the posters share the machine
            cpu += f", posters {r.generator_cpu_us_per_entry:.1f} us/entry"
        if r is not None and r.idle_cores is not None:
            cpu += f", {r.idle_cores:.2f} of {os.cpu_count()} cores idle"
        rows.append(f"| POST /events ingest, JSON token_ids, {b}-entry batches, {posters} concurrent posters | "
                    + (f"{r.event_entries_per_s:,.0f} entries/s{cpu}" if r else "-")
                    + f" | >= {TARGETS[key][0]:,.0f} entries/s | "
                    + f"{_verdict(key, r.event_entries_per_s if r else None)} |")
    return "\n".join(rows)
