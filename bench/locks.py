"""Lock hold and wait times on the lookup path while STORE events stream in (docs/performance.md,
"Lock holds on the lookup path").

Question answered: "does a lookup wait for ingest, and for how long?" The target: no lock
hold above 1 ms on the lookup path under a stream of 5,000 STORE entries/s.

How: ``python -m blendmatch.bench.locks`` starts ``blendmatch serve`` as a subprocess through
:func:`serve_timed` (this module run as ``python -m blendmatch.bench.locks --serve ...``),
which wraps two locks of the real server in a timing proxy before it serves, so no
production code changes:

- the blend index's lock (``BlendIndex._lock``, also its ``write_lock``): a lookup holds it
  to verify its candidates; ingest holds it from the first index write of a run of batches
  to the end of that run (a lookup sees a run whole or not at all);
- the directory's lock (``KeyDirectory._lock``, its ``ingest_lock``): every write holds it;
  the ``tokens_b64`` blend lookup does not take it (this bench shows whether any lookup did).

Each outermost acquire records (monotonic time, thread name, wait, hold). The bench fills the
server (``loadtest``'s workload and fill), runs loadtest's lookup phase (idle ingest) and its
lookup+events phase (one more client streams ``--event-rate`` entries/s in ``--event-batch``
batches, LMCache JSON ``token_ids``), stops the server, which writes its samples at exit,
and prints per phase, lock and thread kind (lookup thread, events thread): count, wait and
hold p50/p99/max, and the number of holds above 1 ms. The proxy costs about 1 us of Python
per acquire (under the GIL), so the figures carry a little more than production's.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["TimedLock", "main", "serve_timed", "summarize"]


class TimedLock:
    """An ``RLock`` that records each outermost hold: (lock, acquired at, thread, wait s, hold s,
    the holding thread's CPU s during the hold). Hold minus CPU is time the holder spent
    off CPU with the lock held: waiting for the GIL or descheduled."""

    def __init__(self, inner: Any, name: str, samples: list[tuple[str, float, str, float, float, float]]) -> None:
        self._inner, self._name, self._samples = inner, name, samples
        self._local = threading.local()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        ok = self._inner.acquire(blocking, timeout)
        if ok:
            local = self._local
            depth = getattr(local, "depth", 0)
            if depth == 0:
                local.at = time.perf_counter()
                local.cpu = time.thread_time()
                local.wait = local.at - t0
            local.depth = depth + 1
        return ok

    def release(self) -> None:
        local = self._local
        local.depth -= 1
        if local.depth == 0:
            self._samples.append((self._name, local.at, threading.current_thread().name, local.wait,
                                  time.perf_counter() - local.at, time.thread_time() - local.cpu))
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def serve_timed(out_path: str, serve_argv: Sequence[str]) -> int:
    """``blendmatch serve *serve_argv`` with the index's and the directory's locks timed;
    the samples go to ``out_path`` (JSON) when the server exits."""
    from blendmatch.index.blend_index import BlendIndex
    from blendmatch.index.key_directory import KeyDirectory
    from blendmatch.service.cli import main as cli_main

    samples: list[tuple[str, float, str, float, float, float]] = []
    for cls, name in ((BlendIndex, "index"), (KeyDirectory, "directory")):
        init = cls.__init__

        def timed_init(self: Any, *a: Any, _init: Any = init, _name: str = name, **k: Any) -> None:
            _init(self, *a, **k)
            self._lock = TimedLock(self._lock, _name, samples)

        cls.__init__ = timed_init  # type: ignore[method-assign]
    atexit.register(lambda: Path(out_path).write_text(json.dumps(samples)))
    return cli_main(["serve", *serve_argv])


def _kind(thread: str) -> str:
    if thread.startswith("blendmatch-lookup"):
        return "lookup thread"
    if thread.startswith("blendmatch-events"):
        return "events thread"
    return "other"


def summarize(samples: Sequence[Sequence[Any]], phases: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    """Rows per (phase, lock, thread kind): count, wait, hold and CPU-in-hold p50/p99/max in
    ms, holds > 1 ms, and of those the ones whose CPU time stayed under 1 ms (off CPU)."""
    groups: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    for lock, at, thread, wait, hold, cpu in samples:
        for phase, (t0, t1) in phases.items():
            if t0 <= at <= t1:
                groups.setdefault((phase, lock, _kind(thread)), []).append((wait, hold, cpu))
    rows = []
    order = list(phases)
    for (phase, lock, kind), vals in sorted(groups.items(), key=lambda g: (order.index(g[0][0]), g[0][1:])):
        arr = np.asarray(vals) * 1e3
        row: dict[str, Any] = {"phase": phase, "lock": lock, "thread": kind, "count": len(vals),
                               "over_1ms": int((arr[:, 1] > 1.0).sum()),
                               "over_1ms_off_cpu": int(((arr[:, 1] > 1.0) & (arr[:, 2] < 1.0)).sum())}
        for j, what in ((0, "wait"), (1, "hold"), (2, "cpu")):
            row.update({f"{what}_p50_ms": float(np.percentile(arr[:, j], 50)),
                        f"{what}_p99_ms": float(np.percentile(arr[:, j], 99)), f"{what}_max_ms": float(arr[:, j].max())})
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| phase | lock | thread | holds | wait p50 / p99 / max ms | hold p50 / p99 / max ms | "
           "CPU in hold p50 / p99 / max ms | holds > 1 ms (of them < 1 ms CPU) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['phase']} | {r['lock']} | {r['thread']} | {r['count']:,} | {r['wait_p50_ms']:.3f} / "
                   f"{r['wait_p99_ms']:.3f} / {r['wait_max_ms']:.2f} | {r['hold_p50_ms']:.3f} / "
                   f"{r['hold_p99_ms']:.3f} / {r['hold_max_ms']:.2f} | {r['cpu_p50_ms']:.3f} / {r['cpu_p99_ms']:.3f} / "
                   f"{r['cpu_max_ms']:.2f} | {r['over_1ms']:,} ({r['over_1ms_off_cpu']:,}) |")
    return "\n".join(out)


async def _drive(url: str, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    from urllib.parse import urlsplit

    from . import loadtest

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", int(parts.port or 80)
    workload = loadtest.Workload(args.chunk_size, args.chunks, args.tokens, args.matches_per_query)
    await loadtest.fill(host, port, workload)
    requests = loadtest.lookup_requests(f"{host}:{port}", workload)
    check = loadtest._make_check(workload.expected_matches())
    common = dict(requests=requests, tokens=args.tokens, clients=args.clients, duration=args.duration,
                  max_requests=10**8, chunk_size=args.chunk_size, generator=args.generator)
    await loadtest.closed_loop(host, port, requests, min(args.clients, len(requests)), 60.0, len(requests), check)
    phases: dict[str, tuple[float, float]] = {}
    for phase, extra in (("lookup, idle ingest", {}),
                         (f"lookup + {args.event_rate:g} entries/s in {args.event_batch}-entry batches",
                          {"event_rate": args.event_rate, "event_batch": args.event_batch})):
        t0 = time.perf_counter()
        r = await loadtest.run_phase(host, port, config="timed locks", phase=phase, **common, **extra)  # type: ignore[arg-type]
        phases[phase] = (t0, time.perf_counter())
        print(loadtest._row(r), flush=True)
    return phases


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return serve_timed(argv[1], argv[2:])
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.locks", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--chunks", type=int, default=100_000)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--matches-per-query", type=int, default=4)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--event-rate", type=float, default=5000.0)
    p.add_argument("--event-batch", type=int, default=64)
    p.add_argument("--generator", choices=("wrk", "python"), default=None, help="default: wrk when installed")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    from . import loadtest
    from .loadgen import free_port, spawn_process, stop_server, wrk_available

    args.generator = args.generator or ("wrk" if wrk_available() else "python")
    loadtest._use_uvloop()
    with tempfile.TemporaryDirectory(prefix="blendmatch-locks-") as tmp:
        out = Path(tmp) / "samples.json"
        port = free_port()
        proc, url = spawn_process([sys.executable, "-m", "blendmatch.bench.locks", "--serve", str(out), "--host",
                                   "127.0.0.1", "--port", str(port), "--engine", "cpu", "--chunk-size",
                                   str(args.chunk_size), "--log-level", "warning"], port,
                                  log_path=Path(tmp) / "server.log")
        try:
            phases = asyncio.run(_drive(url, args))
        finally:
            stop_server(proc)
        if not out.exists():
            raise SystemExit(f"the server wrote no samples: {(Path(tmp) / 'server.log').read_text()[-2000:]}")
        rows = summarize(json.loads(out.read_text()), phases)
    print(f"\n{args.tokens}-token tokens_b64 lookups over {args.chunks:,} chunks, {args.clients} clients "
          f"({args.generator}); lock holds recorded in the server (bench/locks.py):\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
