"""Resident bytes per stored chunk of the whole service, filled through ``POST /events``.

Question answered: "a ``blendmatch serve`` process stored N chunks sent by the fleet's
posters: how many resident bytes does each chunk cost it, directory, index, allocator and
all?" (docs/performance.md, "Memory per chunk"). ``bench/events.py`` measures the directory and index in one
process without HTTP; this measures the serving process itself, as an operator's ``ps``
would: the resident set (``/proc/PID/statm``) after start-up, and again once the last body
was answered and the events thread is idle.

Each round spawns one server per configuration, alternating (the machine may be shared:
alternating exposes every configuration to the same conditions), and fills it with
``--chunks`` new chunks from ``--posters`` connections posting ``--batch``-entry STORE bodies
back to back (``posters.StoreBodies``: LMCache's JSON ``token_ids``, every entry a new chunk
and new content). The configurations are ``on`` (the defaults) and ``off``
(``--no-release-free-heap``: the C allocator keeps its free pages, ``service/heap.py``);
``--server-arg`` adds flags to both. Printed per round and configuration: resident MiB
before and after, bytes per chunk, the fill's entries/s, and the chunks the index holds
(``GET /directory/stats``: a figure counts only if every entry was indexed).

Run: ``python -m blendmatch.bench.service_memory [--chunks 1000000] [--batch 1000]
[--posters 4] [--rounds 2] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from typing import Any, Sequence

from .loadgen import Conn, spawn_server, stop_server
from .posters import StoreBodies

__all__ = ["CONFIGS", "fill", "measure", "main", "resident_bytes"]

#: configuration name -> extra ``serve`` flags
CONFIGS: dict[str, list[str]] = {"on": [], "off": ["--no-release-free-heap"]}

_SERVER_ARGS = ["--engine", "cpu", "--chunk-size", "256", "--log-level", "warning"]


def resident_bytes(pid: int) -> int:
    """The resident set of process ``pid`` (``/proc/PID/statm``), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


async def fill(host: str, port: int, *, chunks: int, batch: int, posters: int, chunk_size: int = 256,
               progress: bool = False) -> dict[str, float]:
    """Post ``chunks`` new chunks in ``batch``-entry bodies from ``posters`` connections (the
    bodies split as evenly as whole bodies allow). Raises ``RuntimeError`` on a non-200."""
    bodies = -(-chunks // batch)
    makers = [StoreBodies(f"{host}:{port}", f"memory-poster-{k}", chunk_size, (k + 1) << 40, seed=k)
              for k in range(posters)]
    conns = [await Conn(host, port).open() for _ in range(posters)]
    sent = [0]
    next_report = [time.perf_counter() + 5.0]

    async def one(k: int) -> None:
        while True:
            i = sent[0]
            if i >= bodies:
                return
            sent[0] += 1
            n = min(batch, chunks - i * batch)
            status, body = await conns[k].request(makers[k].next(n))
            if status != 200:
                raise RuntimeError(f"POST /events answered {status}: {body[:300]!r}")
            if progress and time.perf_counter() > next_report[0]:
                next_report[0] += 5.0
                print(f"  ... {min(sent[0] * batch, chunks):,} of {chunks:,} chunks sent", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(k) for k in range(posters)))
    finally:
        for c in conns:
            await c.close()
    wall = time.perf_counter() - t0
    return {"seconds": wall, "entries_per_s": chunks / wall}


def _settle(url: str, timeout: float = 60.0) -> dict[str, Any]:
    """The directory's stats once the events thread has nothing queued (a trim queued by
    the last body runs there too), polled."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _get_json(f"{url}/directory/stats")
        depth = _events_queue_depth(url)
        if depth == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _events_queue_depth(url: str) -> int:
    """``blendmatch_events_queue_depth`` from ``GET /metrics`` (0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("blendmatch_events_queue_depth "):
                return int(float(line.split()[1]))
    return 0


def measure(*, chunks: int = 1_000_000, batch: int = 1000, posters: int = 4, rounds: int = 2,
            configs: Sequence[str] = tuple(CONFIGS), server_args: Sequence[str] = (),
            progress: bool = False) -> list[dict[str, Any]]:
    """One row per round and configuration (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    for rnd in range(1, rounds + 1):
        for name in configs:
            proc, url = spawn_server([*_SERVER_ARGS, *server_args, *CONFIGS[name]])
            try:
                port = int(url.rsplit(":", 1)[1])
                time.sleep(0.5)  # start-up's own allocations settle (warm-up on the lookup thread)
                rss0 = resident_bytes(proc.pid)
                got = asyncio.run(fill("127.0.0.1", port, chunks=chunks, batch=batch, posters=posters,
                                       progress=progress))
                stats = _settle(url)
                time.sleep(0.5)
                rss1 = resident_bytes(proc.pid)
            finally:
                stop_server(proc)
            indexed = int((stats.get("blend") or {}).get("num_chunks", 0))
            if indexed != chunks:
                raise RuntimeError(f"{name}: {indexed} chunks indexed for {chunks} sent")
            row = {"round": rnd, "config": name, "chunks": chunks, "batch": batch, "posters": posters,
                   "rss_before_mib": rss0 / 2**20, "rss_after_mib": rss1 / 2**20,
                   "bytes_per_chunk": (rss1 - rss0) / chunks, "entries_per_s": got["entries_per_s"]}
            rows.append(row)
            if progress:
                print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    return (f"round {row['round']} {row['config']:>3}: resident {row['rss_before_mib']:,.1f} -> "
            f"{row['rss_after_mib']:,.1f} MiB, {row['bytes_per_chunk']:,.1f} B per chunk, "
            f"fill {row['entries_per_s']:,.0f} entries/s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blendmatch.bench.service_memory",
                                 description=__doc__.split("\n\n")[1] if __doc__ else None)
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000, help="entries per POST /events body")
    ap.add_argument("--posters", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more blendmatch serve argument for every configuration (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        ap.error(f"--configs: unknown {bad or configs}; known: {', '.join(CONFIGS)}")
    if args.chunks < 1 or args.batch < 1 or args.posters < 1 or args.rounds < 1:
        ap.error("--chunks, --batch, --posters and --rounds must be >= 1")
    rows = measure(chunks=args.chunks, batch=args.batch, posters=args.posters, rounds=args.rounds,
                   configs=configs, server_args=args.server_arg, progress=not args.json)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{args.chunks:,} chunks through POST /events, {args.batch}-entry bodies, {args.posters} posters:")
        for row in rows:
            print(_line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
