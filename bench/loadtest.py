"""blendmatch loadtest: drive a server over loopback and report what it sustains.

What one run does (blendmatch loadtest --spawn --compare, the default):

1. for each server configuration, "batching" (the default --max-batch-tokens) and
   "no batching" (--max-batch-tokens equal to one request's tokens), start
   blendmatch serve as a subprocess on 127.0.0.1 (a free port);
2. fill it with --chunks stored chunks through POST /events (STORE batches);
3. measure, each phase --duration seconds with --clients concurrent closed-loop
   clients on keep-alive connections:
   - healthz: GET /healthz, the ceiling of this load generator plus the HTTP stack
     (only for the first configuration: it does not depend on batching);
   - lookup: POST /directory/blend-lookup with --tokens-token queries
     (tokens_b64), each containing --matches-per-query stored chunks;
   - lookup+events: the same while one more client streams STORE events at
     --event-rate entries per second (--event-batch entries per request; default 5,000/s
     in 64-entry batches, LMCache JSON token_ids: the targets' setting);
   - events BxP (first configuration only, --ingest-duration s each): --posters concurrent
     posters (default 4) send POST /events back to back, B entries per request for each B
     of --ingest-batches (default 64 and 1,000), every entry a new chunk: the ingest rate;
4. with --vs-lmcache SITE, LMCache 0.5.6's real coordinator app from its wheel
   (bench/lmcache_serve.py) is filled with the same chunks and measured with the same
   lookups, in the same run;
5. print one table: requests/s, tokens/s, p50/p99 latency, errors, and the mean batch the
   server formed in that phase (from GET /directory/stats before and after); then issue
   28's table (bench/posters.py: issue_table): every figure, with batch sizes and poster
   counts, against its target; an ingest row also gives the server's and the posters' CPU
   per entry and the machine's idle cores during the phase.

With --url http://127.0.0.1:PORT it measures a server you started instead (no
comparison; it fills only with --fill). Only loopback addresses are accepted, and every
phase is bounded in time (--duration) and in count (--max-requests).

Load generators (--generator, default auto): wrk when it is installed (apt-get
install wrk; a generated Lua script sends one pre-built body per request, rotating
through a pool of 64 queries, and prints p50/p99/p99.9 from wrk's own histogram), because on
a 2-core machine a Python generator costs about as much CPU per request as the server and
measures itself; otherwise the python client: raw asyncio sockets (HTTP/1.1
keep-alive, pre-encoded requests, uvloop when available), not httpx, which costs several
times more. Every table row says which generator ran. wrk cannot check answers, so with
wrk each query is checked once in the warm-up (it must return its stored chunks) and
only the status is counted during the phase. The healthz row shows what the
generator itself can reach. The event stream (lookup+events) is always the Python
client, paced by the clock, running beside wrk.

Also reported per phase: the server's CPU seconds per request (from
/proc/<pid>/stat of a spawned server: robust to other load on the machine) and the
histogram of engine batch sizes the server formed (from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import numpy as np

from .loadgen import (Conn, closed_loop, free_port, get_request, idle_cores, machine_ticks, percentile_ms,
                      post_request, proc_cpu_s, spawn_process, spawn_server, stop_server, wrk_available, wrk_loop)
from .posters import MODEL, StoreBodies, entry_text, events_body, issue_table, post_loop

__all__ = ["main", "spawn_server", "stop_server", "PhaseResult", "LOOPBACK_HOSTS", "Workload", "fill", "lookup_requests"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_FILL_BATCH = 2000  # entries per fill request (~3 MB of JSON at 256 tokens)


# ---------------------------------------------------------------------- workload
@dataclass
class Workload:
    """Deterministic data: stored chunks and the queries built from them."""

    chunk_size: int
    chunks: int
    tokens: int
    matches_per_query: int
    seed: int = 0
    pool: int = 64

    def block(self, b: int) -> np.ndarray:
        """Chunks ``b * _FILL_BATCH ...`` (one fill request's worth), deterministic."""
        rng = np.random.default_rng([self.seed, b])
        n = min(_FILL_BATCH, self.chunks - b * _FILL_BATCH)
        return rng.integers(0, 50_000, size=(n, self.chunk_size), dtype=np.uint32)

    def fill_bodies(self, first_seq: int = 1, per_request: int = _FILL_BATCH) -> list[bytes]:
        """The fill's ``POST /events`` bodies, ``per_request`` entries each (a Kafka-mode server
        appends each batch as one record, and brokers refuse records over ~1 MB by default:
        ``--fill-batch 200`` keeps them near 300 KB). The stored data does not depend on it."""
        bodies = []
        seq = first_seq
        for b, start in enumerate(range(0, self.chunks, _FILL_BATCH)):
            rows = self.block(b)
            entries = [_entry(start + j, row, ((start + j) % 64) * self.chunk_size) for j, row in enumerate(rows)]
            for k in range(0, len(entries), per_request):
                bodies.append(events_body("loadtest-fill", seq, entries[k:k + per_request]))
                seq += 1
        return bodies

    def queries(self) -> list[np.ndarray]:
        """``pool`` queries of ``tokens`` filler ids (>= 60,000: never stored) with
        :meth:`expected_matches` stored chunks, each at a random offset inside its own
        ``2 * chunk_size`` slot (so they never overlap and rarely align to chunk boundaries)."""
        rng = np.random.default_rng([self.seed, 1 << 40])
        out = []
        c = self.chunk_size
        k = self.expected_matches()
        for _ in range(self.pool):
            q = rng.integers(60_000, 100_000, size=self.tokens, dtype=np.uint32)
            for slot in rng.choice(self.tokens // (2 * c), size=k, replace=False) if k else ():
                i = int(rng.integers(self.chunks))
                pos = int(slot) * 2 * c + int(rng.integers(0, c + 1))
                q[pos:pos + c] = self.block(i // _FILL_BATCH)[i % _FILL_BATCH]
            out.append(q)
        return out

    def expected_matches(self) -> int:
        """Stored chunks inside each query (each is a match)."""
        return min(self.matches_per_query, self.tokens // (2 * self.chunk_size)) if self.chunks else 0


def _entry(i: int, row: np.ndarray, offset: int, model: str = MODEL) -> str:
    return entry_text(i, ",".join(map(str, row.tolist())), offset, model)


# ---------------------------------------------------------------------- phases
@dataclass
class PhaseResult:
    config: str
    phase: str
    clients: int
    requests: int
    errors: int
    seconds: float
    rps: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float | None = None
    events_sent: int = 0
    event_entries_per_s: float = 0.0
    event_p99_ms: float = 0.0
    event_errors: int = 0
    generator: str = "python"
    p999_ms: float = float("nan")
    server_cpu_us_per_req: float | None = None
    generator_cpu_us_per_entry: float | None = None  # ingest phases: the posters' own CPU
    idle_cores: float | None = None  # the machine's cores left idle during the phase
    batch_histogram: dict[str, int] = field(default_factory=dict)


async def _event_stream(host: str, port: int, rate: float, batch: int, chunk_size: int, stop: asyncio.Event,
                        first_id: int, seed: int) -> tuple[int, list[float], int]:
    """STORE events at ``rate`` entries/s in requests of ``batch`` entries, paced by the
    clock (a slow server makes it fall behind, which the achieved rate shows)."""
    conn = await Conn(host, port).open()
    interval = batch / rate
    bodies = StoreBodies(f"{host}:{port}", f"loadtest-stream-{seed}", chunk_size, first_id, seed)
    sent = 0
    errors = 0
    lat: list[float] = []
    next_at = time.perf_counter()
    while not stop.is_set():
        raw = bodies.next(batch)
        delay = next_at - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except asyncio.TimeoutError:
                pass
        t0 = time.perf_counter()
        try:
            status, _ = await conn.request(raw)
            errors += status != 200
        except (OSError, asyncio.IncompleteReadError, RuntimeError):
            errors += 1
            await conn.close()
        lat.append(time.perf_counter() - t0)
        sent += batch
        next_at += interval
    await conn.close()
    return sent, lat, errors


async def _snapshot(host: str, port: int, replica: Any = None, tries: int = 12
                    ) -> tuple[dict[str, Any], dict[str, float]] | None:
    """``(/directory/stats, batch buckets)`` read over one connection, so both come from the
    same process. With ``serve --workers`` each connection reaches one worker, whose counters
    are its own: given ``replica`` (the ``log.replica_id`` of the first snapshot), retry on new
    connections until that worker answers; None when it did not within ``tries``."""
    for _ in range(tries):
        conn = await Conn(host, port).open()
        try:
            status, body = await conn.request(get_request(host, "/directory/stats"))
            if status != 200:
                raise RuntimeError(f"/directory/stats answered {status}: {body[:200]!r}")
            stats = json.loads(body)
            mstatus, mbody = await conn.request(get_request(host, "/metrics"))
        finally:
            await conn.close()
        if replica is None or _replica_of(stats) == replica:
            return stats, _parse_buckets(mstatus, mbody)
    return None


def _replica_of(stats: dict[str, Any]) -> Any:
    log = stats.get("blendmatch", {}).get("log")
    return log.get("replica_id") if isinstance(log, dict) else None


def _parse_buckets(status: int, body: bytes) -> dict[str, float]:
    """Cumulative ``blendmatch_batch_queries`` buckets from a ``/metrics`` answer."""
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("blendmatch_batch_queries_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def _histogram(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Batches per size range in the phase (from two cumulative snapshots)."""
    def key(le: str) -> float:
        return float("inf") if le == "+Inf" else float(le)

    out: dict[str, int] = {}
    prev_le, prev = "0", 0.0
    for le in sorted(after, key=key):
        cum = after[le] - before.get(le, 0.0)
        n = int(round(cum - prev))
        if n:
            lo = int(key(prev_le)) + 1
            hi = "inf" if le == "+Inf" else str(int(key(le)))
            out[f"{lo}-{hi}" if str(lo) != hi else hi] = n
        prev_le, prev = le, cum
    return out


async def run_phase(host: str, port: int, *, config: str, phase: str, requests: list[bytes], tokens: int,
                    clients: int, duration: float, max_requests: int, event_rate: float = 0.0,
                    event_batch: int = 50, chunk_size: int = 256, check: Any = None,
                    event_first_id: int = 1 << 60, generator: str = "python",
                    server_pid: int | None = None) -> PhaseResult:
    snap0 = await _snapshot(host, port) if tokens else None
    stop = asyncio.Event()
    stream = None
    if event_rate > 0:
        stream = asyncio.create_task(_event_stream(host, port, event_rate, event_batch, chunk_size, stop,
                                                   event_first_id, seed=event_first_id & 0xFFFF))
    cpu0 = proc_cpu_s(server_pid)
    if generator == "wrk":
        got, wall = await wrk_loop(host, port, requests, clients, duration)
        n, wall = int(got["requests"]), float(got["seconds"]) or wall
        errors = int(got["non200"]) + int(got["socket_errors"])
        pct = (got["p50_us"] / 1e3, got["p99_us"] / 1e3, got["max_us"] / 1e3, got["p999_us"] / 1e3)
    else:
        lat, errors, wall = await closed_loop(host, port, requests, clients, duration, max_requests, check)
        n = len(lat)
        pct = (percentile_ms(lat, 50), percentile_ms(lat, 99), percentile_ms(lat, 100), percentile_ms(lat, 99.9))
    cpu1 = proc_cpu_s(server_pid)
    stop.set()
    sent, ev_lat, ev_err = await stream if stream is not None else (0, [], 0)
    res = PhaseResult(config, phase, clients, n, errors, wall, n / wall, n * tokens / wall, pct[0], pct[1], pct[2],
                      generator=generator, p999_ms=pct[3])
    if cpu0 is not None and cpu1 is not None and n:
        res.server_cpu_us_per_req = (cpu1 - cpu0) / n * 1e6
    snap1 = await _snapshot(host, port, replica=_replica_of(snap0[0])) if snap0 is not None else None
    if snap0 is not None and snap1 is not None:  # one process's batches (one worker's with --workers)
        (before, buckets0), (after, buckets1) = snap0, snap1
        res.batch_histogram = _histogram(buckets0, buckets1)
        # blendmatch's own stats (absent on other servers, LMCache's)
        b0, b1 = before.get("blendmatch", {}).get("batcher"), after.get("blendmatch", {}).get("batcher")
        batches = b1["batches"] - b0["batches"] if b0 and b1 else 0
        res.mean_batch = (b1["queries"] - b0["queries"]) / batches if batches else None
    if stream is not None:
        res.events_sent, res.event_entries_per_s = sent, sent / wall
        res.event_p99_ms, res.event_errors = percentile_ms(ev_lat, 99), ev_err
    return res


async def ingest_phase(host: str, port: int, *, config: str, posters: int, batch: int, duration: float,
                       chunk_size: int, first_id: int, server_pid: int | None = None) -> PhaseResult:
    """``POST /events`` as fast as ``posters`` concurrent posters get answers, ``batch``
    entries per request (LMCache's JSON, ``token_ids`` lists), every entry a new chunk."""
    cpu0, ticks0 = proc_cpu_s(server_pid), machine_ticks()
    got = await post_loop(host, port, posters=posters, batch=batch, duration=duration, chunk_size=chunk_size,
                          first_id=first_id)
    cpu1, ticks1 = proc_cpu_s(server_pid), machine_ticks()
    wall = got["seconds"]
    res = PhaseResult(config, f"events {batch}x{posters}", posters, got["posts"], got["errors"], wall,
                      got["posts"] / wall, got["entries"] * chunk_size / wall, got["p50_ms"], got["p99_ms"],
                      got["max_ms"], events_sent=got["entries"], event_entries_per_s=got["entries"] / wall,
                      event_p99_ms=got["p99_ms"])
    if cpu0 is not None and cpu1 is not None and got["posts"]:
        res.server_cpu_us_per_req = (cpu1 - cpu0) / got["posts"] * 1e6
    res.generator_cpu_us_per_entry = got["generator_cpu_s"] / max(got["entries"], 1) * 1e6
    res.idle_cores = idle_cores(ticks0, ticks1)
    return res


async def fill(host: str, port: int, workload: Workload, per_request: int = _FILL_BATCH) -> float:
    """Store ``workload.chunks`` chunks; returns seconds taken (server side included)."""
    conn = await Conn(host, port).open()
    t0 = time.perf_counter()
    try:
        for body in workload.fill_bodies(per_request=per_request):
            status, resp = await conn.request(post_request(host, "/events", body))
            if status != 200:
                raise RuntimeError(f"fill failed: {status} {resp[:300]!r}")
    finally:
        await conn.close()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- orchestration
def lookup_requests(host: str, workload: Workload, token_form: str = "b64") -> list[bytes]:
    """The lookup phases' requests, one per query of ``workload`` (``tokens_b64`` or, with
    ``token_form="ids"``, LMCache's ``token_ids`` form), as raw HTTP/1.1."""
    import base64

    reqs = []
    for q in workload.queries():
        if token_form == "ids":  # LMCache's form: world_size and cache_salt given, as its client does
            body = json.dumps({"token_ids": q.tolist(), "model_name": MODEL, "world_size": 1,
                               "cache_salt": ""}).encode()
        else:
            body = json.dumps({"tokens_b64": base64.b64encode(q.astype("<u4").tobytes()).decode(),
                               "model_name": MODEL}).encode()
        reqs.append(post_request(host, "/directory/blend-lookup", body))
    return reqs


def _make_check(expect_min: int):
    def check(body: bytes) -> bool:
        return body.count(b'"cur_st"') >= expect_min

    return check


async def _measure(url: str, config_name: str, args: argparse.Namespace, workload: Workload, *,
                   healthz: bool, fill_first: bool, server_pid: int | None = None,
                   ingest: bool = True) -> list[PhaseResult]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", int(parts.port or 80)
    hosthdr = f"{host}:{port}"
    results: list[PhaseResult] = []
    if fill_first and workload.chunks:
        secs = await fill(host, port, workload, args.fill_batch)
        print(f"[{config_name}] stored {workload.chunks} chunks in {secs:.1f} s "
              f"({workload.chunks / secs:,.0f} entries/s)", flush=True)
    requests = lookup_requests(hosthdr, workload, getattr(args, "token_form", "b64"))
    check = _make_check(workload.expected_matches())
    common = dict(clients=args.clients, max_requests=args.max_requests, chunk_size=workload.chunk_size,
                  generator=args.generator, server_pid=server_pid)
    # warm-up: every query once, checked (also pays any first-use cost)
    lat, errors, _ = await closed_loop(host, port, requests, min(args.clients, len(requests)), 60.0,
                                        len(requests), check)
    if errors:
        raise RuntimeError(f"[{config_name}] warm-up lookups failed or missed their stored chunks ({errors})")
    if healthz and getattr(args, "healthz", True):
        results.append(await run_phase(host, port, config=config_name, phase="healthz",
                                       requests=[get_request(hosthdr, "/healthz")], tokens=0,
                                       duration=min(args.duration, 5.0), **common))
        print(_row(results[-1]), flush=True)
    results.append(await run_phase(host, port, config=config_name, phase="lookup", requests=requests,
                                   tokens=workload.tokens, duration=args.duration, check=check, **common))
    print(_row(results[-1]), flush=True)
    if args.event_rate > 0 and ingest:
        results.append(await run_phase(host, port, config=config_name, phase="lookup+events", requests=requests,
                                       tokens=workload.tokens, duration=args.duration, check=check,
                                       event_rate=args.event_rate, event_batch=args.event_batch,
                                       event_first_id=(1 << 60) + len(results) * (1 << 40), **common))
        print(_row(results[-1]), flush=True)
    for k, batch in enumerate(args.ingest_batches if ingest and args.posters else ()):
        results.append(await ingest_phase(host, port, config=config_name, posters=args.posters, batch=batch,
                                          duration=args.ingest_duration, chunk_size=workload.chunk_size,
                                          first_id=(1 << 61) + k * (1 << 44), server_pid=server_pid))
        print(_row(results[-1]), flush=True)
    return results


_HEADER = ("| config | phase | generator | clients | req/s | tokens/s | p50 ms | p99 ms | p99.9 ms | max ms | errors | "
           "server CPU us/req | mean batch | batch sizes | events/s | event p99 ms |")


def _row(r: PhaseResult) -> str:
    mb = f"{r.mean_batch:.1f}" if r.mean_batch is not None else "-"
    ev = f"{r.event_entries_per_s:,.0f}" if r.events_sent else "-"
    evp = f"{r.event_p99_ms:.1f}" if r.events_sent else "-"
    tps = f"{r.tokens_per_s / 1e6:.2f} M" if r.tokens_per_s else "-"
    cpu = f"{r.server_cpu_us_per_req:.0f}" if r.server_cpu_us_per_req is not None else "-"
    hist = " ".join(f"{k}:{v}" for k, v in r.batch_histogram.items()) or "-"
    return (f"| {r.config} | {r.phase} | {r.generator} | {r.clients} | {r.rps:,.0f} | {tps} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {r.p999_ms:.2f} | {r.max_ms:.1f} | {r.errors + r.event_errors} | {cpu} | {mb} | {hist} | "
            f"{ev} | {evp} |")


def table(results: list[PhaseResult]) -> str:
    sep = "|" + "---|" * (_HEADER.count("|") - 1)
    return "\n".join([_HEADER, sep, *(_row(r) for r in results)])


LMCACHE = "LMCache 0.5.6"


def _measure_lmcache(args: argparse.Namespace, workload: Workload) -> list[PhaseResult]:
    """LMCache's real coordinator (``bench/lmcache_serve.py``) filled with the same chunks,
    then the same lookup phase (its lookups only: it is the reference for lookups/s)."""
    import sys

    site = Path(args.vs_lmcache).resolve()
    if not (site / "lmcache" / "v1" / "mp_coordinator" / "app.py").is_file():
        raise SystemExit(f"blendmatch loadtest: --vs-lmcache {site} holds no unpacked LMCache wheel")
    port = free_port()
    log_path = Path(args.server_log_dir) / "lmcache.log" if args.server_log_dir else None
    proc, url = spawn_process([sys.executable, str(Path(__file__).with_name("lmcache_serve.py")), str(site), str(port),
                               str(args.chunk_size)], port, log_path=log_path)
    try:
        return asyncio.run(_measure(url, LMCACHE, args, workload, healthz=False, fill_first=True,
                                    server_pid=proc.pid, ingest=False))
    finally:
        stop_server(proc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blendmatch loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--spawn", action="store_true", default=True,
                       help="start the server(s) as subprocesses on 127.0.0.1 (default)")
    where.add_argument("--url", help="measure a running server instead (loopback only)")
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="with --spawn: measure only the batching configuration")
    p.add_argument("--engine", default="cpu", help="--engine of spawned servers (default %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for spawned servers (repeatable), e.g. --server-arg=--max-batch-wait-ms=1")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per lookup (default %(default)s)")
    p.add_argument("--chunks", type=int, default=100_000, help="chunks stored before measuring")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--matches-per-query", type=int, default=4, help="stored chunks inside each query")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=2_000_000, help="request cap per phase")
    p.add_argument("--event-rate", type=float, default=5000.0,
                   help="STORE entries/s during the lookup+events phase; 0 skips it (default %(default)s)")
    p.add_argument("--event-batch", type=int, default=64, help="entries per event request (default %(default)s)")
    p.add_argument("--posters", type=int, default=None,
                   help="concurrent posters in the ingest phases (which store new chunks); 0 skips them "
                        "(default 4 with --spawn, 0 with --url: a running server is not grown unasked)")
    p.add_argument("--ingest-batches", type=lambda v: [int(x) for x in v.split(",")], default=[64, 1000],
                   metavar="B,B", help="entries per POST /events in the ingest phases, one phase each "
                                       "(default 64,1000)")
    p.add_argument("--ingest-duration", type=float, default=5.0, help="seconds per ingest phase (default %(default)s)")
    p.add_argument("--vs-lmcache", metavar="SITE",
                   help="also measure LMCache 0.5.6's real coordinator app (SITE: the unpacked wheel, e.g. "
                        ".pytest_cache/lmcache-0.5.6) on the same chunks and lookups, in the same run")
    p.add_argument("--fill", action="store_true", help="with --url: store --chunks chunks first")
    p.add_argument("--fill-batch", type=int, default=_FILL_BATCH,
                   help="entries per fill request (200 for a Kafka-mode server: one record per batch)")
    p.add_argument("--server-pid", type=int, help="with --url: the server's process id, for its CPU per request")
    p.add_argument("--no-healthz", dest="healthz", action="store_false", help="skip the healthz phase")
    p.add_argument("--generator", choices=("auto", "wrk", "python"), default="auto",
                   help="load generator: wrk when installed (auto), else the Python client (default %(default)s)")
    p.add_argument("--token-form", choices=("b64", "ids"), default="b64",
                   help="lookup bodies carry tokens_b64 (ours) or token_ids lists (LMCache's) (default %(default)s)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--server-log-dir", help="keep spawned servers' logs here")
    return p


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("clients", "tokens", "chunk_size", "event_batch", "max_requests"):
        if getattr(args, name) < 1:
            raise SystemExit(f"blendmatch loadtest: --{name.replace('_', '-')} must be >= 1")
    if args.duration <= 0 or args.duration > 600:
        raise SystemExit("blendmatch loadtest: --duration must be in (0, 600] seconds")
    if args.posters is None:
        args.posters = 0 if args.url else 4
    if args.posters < 0 or not 0 < args.ingest_duration <= 600 or min(args.ingest_batches) < 1:
        raise SystemExit("blendmatch loadtest: --posters >= 0, --ingest-duration in (0, 600], --ingest-batches >= 1")
    workload = Workload(args.chunk_size, args.chunks, args.tokens, args.matches_per_query)
    if args.generator == "auto":
        args.generator = "wrk" if wrk_available() else "python"
    elif args.generator == "wrk" and not wrk_available():
        raise SystemExit("blendmatch loadtest: --generator wrk but wrk is not installed (apt-get install wrk)")
    _use_uvloop()
    results: list[PhaseResult] = []
    print(f"clients {args.clients}, {args.tokens}-token lookups, {args.chunks} chunks of {args.chunk_size}, "
          f"{args.duration:g} s per phase, events {args.event_rate:g}/s; CPUs: {os.cpu_count()}; "
          f"generator: {args.generator}; tokens as {args.token_form}", flush=True)
    if args.url:
        host = urlsplit(args.url).hostname
        if host not in LOOPBACK_HOSTS:
            raise SystemExit(f"blendmatch loadtest: only loopback servers may be driven, got {host!r}")
        config = "as running"
        results += asyncio.run(_measure(args.url, config, args, workload, healthz=True, fill_first=args.fill,
                                        server_pid=args.server_pid))
    else:
        config = "batching"
        configs: list[tuple[str, list[str]]] = [("batching", [])]
        if args.compare:
            configs.append(("no batching", ["--max-batch-tokens", str(args.tokens)]))
        for i, (name, extra) in enumerate(configs):
            log_path = (Path(args.server_log_dir) / f"server-{i}.log") if args.server_log_dir else None
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
            server_args = ["--engine", args.engine, "--chunk-size", str(args.chunk_size), "--log-level", "warning",
                           *args.server_arg, *extra]
            proc, url = spawn_server(server_args, log_path=log_path)
            try:
                results += asyncio.run(_measure(url, name, args, workload, healthz=(i == 0), fill_first=True,
                                                server_pid=proc.pid, ingest=(i == 0)))
            finally:
                stop_server(proc)
    if args.vs_lmcache:
        results += _measure_lmcache(args, workload)
    print()
    print(table(results))
    form = "tokens_b64" if args.token_form == "b64" else "token_ids"
    print(f"\nThe service's targets ({args.tokens}-token {form} lookups over {args.chunks:,} chunks of "
          f"{args.chunk_size}, {args.clients} clients, {args.generator}; ingest phases {args.ingest_duration:g} s "
          "each, every entry a new chunk):\n")
    print(issue_table(results, config=config, lmcache=LMCACHE if args.vs_lmcache else None,
                      event_rate=args.event_rate, event_batch=args.event_batch, posters=args.posters,
                      ingest_batches=args.ingest_batches))
    by = {(r.config, r.phase): r for r in results}
    if ("batching", "lookup") in by and ("no batching", "lookup") in by:
        ratio = by[("batching", "lookup")].rps / max(by[("no batching", "lookup")].rps, 1e-9)
        print(f"\nbatching / no batching, lookup requests/s: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    bad = sum(r.errors + r.event_errors for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
