"""Where the blend-lookup ceiling is: the same lookups against a bare server, the real
server with its lookup thread cut short, and the real server.

Question answered: "with ``wrk -t1 -c32`` on the same cores, how many 8,192-token lookups
per second would one process answer if the transport were all it did, and if the lookups
themselves cost nothing?" (docs/performance.md, "Where a lookup's time goes").
Every stage is driven by ``wrk`` with ``loadtest``'s own lookup requests (``tokens_b64``,
64 distinct queries rotating, each holding 4 stored chunks), stages alternating within
each round:

- ``bare``: ``bench/floor.py``'s bare uvloop server (reads each request whole by its
  ``Content-Length``), answering every request with an answer of the real size;
- ``http``: ``blendmatch serve`` whose lookup thread answers each micro-batch with that
  same answer, without decoding or probing (``ServiceContext._run_lookups`` replaced in
  the spawned process only): uvicorn, the limits, access control, the fast path's
  parsing and validation, the micro-batcher's hand-off to the lookup thread and back;
- ``full``: ``blendmatch serve`` unchanged, filled with ``--chunks`` chunks first.

Printed per stage and round: lookups/s, p50 and p99 (wrk's), the server's CPU per lookup
split into the event loop's thread and the rest (the lookup thread and its helpers), and
wrk's own CPU per lookup (it shares the 2 cores). ``full`` minus ``http`` is what
decoding, probing, verifying and encoding cost in the server; ``http`` minus ``bare`` what
the framework and the hand-offs cost.

Run: ``python -m blendmatch.bench.floor_lookups [--rounds 3] [--duration 5] [--chunks
100000] [--json]``. Needs ``wrk`` (``apt-get install -y wrk``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
from typing import Any, Sequence

from .floor import serve_bare
from .floor_stages import thread_cpu
from .loadgen import free_port, proc_cpu_s, spawn_process, stop_server, wrk_available, wrk_loop
from .loadtest import Workload, fill, lookup_requests

__all__ = ["ANSWER", "STAGES", "main", "measure", "spawn_stage"]

STAGES = ("bare", "http", "full")

#: The answer the ``bare`` and ``http`` stages give every lookup: four matches, the shape and
#: size (327 bytes) of the real server's answers to these queries.
ANSWER = ('{"matches":[' + ",".join(
    f'{{"chunk_hash":"{h:032x}","old_st":{old},"cur_st":{cur}}}'
    for h, old, cur in ((0x138, 14336, 1778), (0xBB3B, 15104, 2728), (0x742A, 10752, 4200), (0x4E01, 9984, 6871))
) + "]}").encode()

_SERVER_ARGS = ["--engine", "cpu", "--chunk-size", "256", "--log-level", "warning"]


def _serve_stage(stage: str, argv: list[str]) -> int:  # pragma: no cover - runs in the spawned server
    """``blendmatch serve argv``, with the lookup thread's work cut at ``stage``."""
    from blendmatch.service import cli
    from blendmatch.service.context import ServiceContext

    if stage == "http":
        def canned(self: Any, queries: list[Any]) -> list[bytes]:
            return [ANSWER] * len(queries)

        ServiceContext._run_lookups = canned  # type: ignore[method-assign]
    return cli.main(["serve", *argv])


def _drive(port: int, requests: list[bytes], clients: int, duration: float, pid: int,
           split_threads: bool) -> dict[str, Any]:
    """``wrk`` for 2 s (warm-up), then ``duration`` s measured: rates, latency, CPU."""
    asyncio.run(wrk_loop("127.0.0.1", port, requests, clients, min(2.0, duration)))
    before = thread_cpu(pid) if split_threads else None
    total0 = proc_cpu_s(pid) or 0.0
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    got, wall = asyncio.run(wrk_loop("127.0.0.1", port, requests, clients, duration))
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    total1 = proc_cpu_s(pid) or 0.0
    after = thread_cpu(pid) if split_threads else None
    n = max(1, int(got["requests"]))
    seconds = float(got["seconds"]) or wall
    row = {"lookups_per_s": int(got["requests"]) / seconds, "errors": int(got["non200"]) + int(got["socket_errors"]),
           "p50_ms": got["p50_us"] / 1e3, "p99_ms": got["p99_us"] / 1e3,
           "server_us": 1e6 * (total1 - total0) / n,
           "wrk_us": 1e6 * (child1.ru_utime + child1.ru_stime - child0.ru_utime - child0.ru_stime) / n,
           "load": os.getloadavg()[0]}
    if before is not None and after is not None:
        row["loop_us"] = 1e6 * (after["loop"] - before["loop"]) / n
        row["rest_us"] = 1e6 * (after["rest"] - before["rest"]) / n
    return row


def spawn_stage(stage: str, port: int) -> subprocess.Popen:
    """``blendmatch serve`` on ``127.0.0.1:port`` cut at ``stage`` (``http`` or ``full``),
    ready (its ``/healthz`` answered); stop it with ``loadgen.stop_server``."""
    if stage not in ("http", "full"):
        raise ValueError(f"stage must be http or full, got {stage!r}")
    cmd = [sys.executable, "-m", "blendmatch.bench.floor_lookups", "--serve-stage", stage, "--",
           "--host", "127.0.0.1", "--port", str(port), *_SERVER_ARGS]
    return spawn_process(cmd, port)[0]


def _one(stage: str, workload: Workload, clients: int, duration: float) -> dict[str, Any]:
    port = free_port()
    requests = lookup_requests(f"127.0.0.1:{port}", workload)
    if stage == "bare":
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=serve_bare, args=(port, ready, ANSWER), daemon=True)
        proc.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("the bare server did not start")
            return {"stage": stage, **_drive(port, requests, clients, duration, proc.pid, split_threads=False)}
        finally:
            proc.terminate()
            proc.join(10)
    server = spawn_stage(stage, port)
    try:
        if stage == "full":
            asyncio.run(fill("127.0.0.1", port, workload))
        return {"stage": stage, **_drive(port, requests, clients, duration, server.pid, split_threads=True)}
    finally:
        stop_server(server)


def measure(rounds: int, duration: float, chunks: int, tokens: int = 8192, clients: int = 32,
            stages: Sequence[str] = STAGES) -> list[dict[str, Any]]:
    """Every stage ``rounds`` times, stages alternating within a round."""
    if not wrk_available():
        raise RuntimeError("floor_lookups needs wrk (apt-get install -y wrk)")
    workload = Workload(256, chunks, tokens, 4)
    rows = []
    for r in range(rounds):
        for stage in stages:
            rows.append({"round": r, "clients": clients, **_one(stage, workload, clients, duration)})
            print(f"  {stage} round {r}: {rows[-1]['lookups_per_s']:,.0f} lookups/s", file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-stage"]:  # the spawned server
        if len(argv) < 2 or argv[1] not in ("http", "full"):
            raise SystemExit("--serve-stage takes http or full")
        return _serve_stage(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.floor_lookups",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per stage (after 2 s of warm-up)")
    p.add_argument("--chunks", type=int, default=100_000, help="chunks stored before the full stage")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per lookup")
    p.add_argument("--clients", type=int, default=32, help="wrk connections")
    p.add_argument("--stages", type=lambda v: v.split(","), default=list(STAGES), metavar="S[,S]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.chunks < 1 or args.tokens < 512 or args.clients < 1:
        p.error("--rounds, --duration, --chunks and --clients must be positive, --tokens at least 512")
    if not set(args.stages) <= set(STAGES):
        p.error(f"--stages takes {', '.join(STAGES)}")
    if not wrk_available():
        p.error("wrk is not installed (apt-get install -y wrk)")
    rows = measure(args.rounds, args.duration, args.chunks, args.tokens, args.clients, args.stages)
    if args.json:
        print(json.dumps({"stages": rows}))
        return 0
    print(f"{args.tokens}-token tokens_b64 lookups, wrk -t1 -c{args.clients}, {args.duration:g} s per stage")
    print("| stage | round | lookups/s | p50 / p99 ms | server us/lookup (loop + rest) | wrk us/lookup | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        split = f" ({r['loop_us']:.0f} + {r['rest_us']:.0f})" if "loop_us" in r else ""
        print(f"| {r['stage']} | {r['round']} | {r['lookups_per_s']:,.0f} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} | "
              f"{r['server_us']:.0f}{split} | {r['wrk_us']:.0f} | {r['load']:.2f} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
