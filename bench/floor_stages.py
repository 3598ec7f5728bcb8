"""Where the ``POST /events`` ceiling is: the real server with its events thread cut short.

Question answered: "with the same posters on the same cores, how many entries per second
would the server take if applying cost nothing, and if decoding cost nothing too; and what
does its events thread's work cost with no server around it?" (docs/performance.md,
"Where ingest's time goes"). Three ``blendmatch serve`` processes are spawned in turn,
alternating rounds, each driven by ``loadtest``'s posters (``posters.post_loop``: 4
connections posting back to back, every entry a new chunk):

- ``http``: the real server (uvicorn, the fast path, the events thread's hand-off and
  reply) whose events thread answers each body as applied without reading it (and whose
  prepare thread does not split large bodies);
- ``decode``: the same, decoding and validating each body as the real one does
  (``event_source._decode``: the entries pass, pydantic-core) and then not applying it;
- ``full``: the real server, unchanged;
- ``alone``: no server and no posters: a fresh interpreter runs the events thread's own
  work (``event_source.decode_and_apply_run``) on the same bodies, grouped into runs as the
  events thread groups what 4 posters can queue (bounded by its ``max_run_bytes``), with
  the service's GC freeze and free-heap release every ``--gc-freeze-ingest-bytes``; only
  the calls are timed (the bodies are made between them). Its ``rest`` is that thread's
  CPU per entry: set beside ``full``'s, what the same work costs inside the server. One
  thread does all of it, the entries pass included, which the server runs on its prepare
  thread for bodies of 256 KiB and more (``event_source.PREPARE_MIN_BYTES``): at 1,000-entry
  bodies ``alone`` is the work's cost, not the server's ceiling. With ``--probe-gil`` a
  thread asks for the GIL every millisecond, as the lookup thread would, and the stage
  reports its longest waits with the keys stored by then: the work's holds of the GIL in
  one piece (a directory dict's or set's resize grows with the keys), which a lookup
  would wait out whole; and its longest runs, the events thread's stalls (those and the
  index's growths).

Cutting the events thread short is done in the spawned process only (``_serve_stage``
replaces ``event_source.decode_and_apply_run`` before the CLI starts); nothing in the
service knows about it. Printed per stage and batch size: entries/s, the server's CPU per
entry split into the event loop's thread and the rest (the events thread and its helpers),
and the posters' CPU per entry. ``full`` minus ``decode`` is what applying costs in the
server; ``decode`` minus ``http`` what decoding costs; ``http`` is what the transport, the
framework and the hand-offs cost (``bench/floor.py`` is the bare-socket floor below it).

Run: ``python -m blendmatch.bench.floor_stages [--batches 64,1000] [--rounds 3]
[--duration 5] [--stages S[,S]] [--probe-gil] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Sequence

from .loadgen import free_port, spawn_process, stop_server
from .posters import post_loop

__all__ = ["STAGES", "main", "measure", "thread_cpu"]

STAGES = ("http", "decode", "full", "alone")
SERVER_STAGES = STAGES[:3]  # the stages that spawn a server


def _serve_stage(stage: str, argv: list[str]) -> int:  # pragma: no cover - runs in the spawned server
    """``blendmatch serve argv`` with the events thread's work cut at ``stage``."""
    from blendmatch.index.ingest import ApplyCounts, ApplyReport
    from blendmatch.service import cli, event_source

    if stage != "full":
        # compile first, with the real events path: the service's warm-up drives a scratch
        # service through it and checks its answers (once per process, so serve's own
        # compile step below returns at once)
        from blendmatch.service.config import ServiceConfig
        from blendmatch.service.warmup import compile_everything

        compile_everything(ServiceConfig())
        real_decode = event_source._decode

        def cut(directory: Any, bodies: list[tuple[Any, ...]], max_instances: Any = None) -> list[Any]:
            out: list[Any] = []
            for raw, _, *split in bodies:
                if stage == "decode":
                    request = real_decode(raw, *split)
                    batches, entries = len(request.batches), sum(len(b.entries) for b in request.batches)
                else:
                    batches, entries = 1, 0
                out.append(ApplyReport(ApplyCounts(batches, 0, 0), entries, {}))
            return out

        event_source.decode_and_apply_run = cut
        if stage == "http":  # nor the split of large bodies on the prepare thread
            event_source.prepare_body = lambda raw, may_act_for=None: None
    return cli.main(["serve", *argv])


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of ``pid``: ``loop`` (the main thread) and ``rest``."""
    out = {"loop": 0.0, "rest": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out["loop" if tid == str(pid) else "rest"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _gil_probe(applied: list[int], gaps: list[tuple[float, int]], stop: Any, every: float = 0.001) -> None:
    """A thread that asks for the GIL every ``every`` s, as a lookup thread would, and notes
    each wait over 10 ms with the keys applied by then: how long the work held the GIL in
    one piece (a Python dict's or set's resize, a collection), what a lookup would wait."""
    import time

    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(every)
        now = time.perf_counter()
        if now - last - every > 0.01 and applied[0]:  # (the first run loads or compiles the kernels)
            gaps.append((now - last - every, applied[0]))
        last = now


def _run_alone(batch: int, posters: int, duration: float, first_id: int, probe: bool = False) -> dict[str, Any]:
    """Stage ``alone`` (see the module docstring), in this interpreter (the stage spawns a
    fresh one for it; the tests call it in theirs); with ``probe`` a
    thread notes the GIL's longest holds (:func:`_gil_probe`), and the longest runs (the
    events thread's stalls: a growth, a resize) are reported with them."""
    import gc
    import threading
    import time

    from blendmatch.index import KeyDirectory
    from blendmatch.service.config import ServiceConfig
    from blendmatch.service.event_source import decode_and_apply_run
    from blendmatch.service.events_thread import MAX_RUN_BYTES
    from blendmatch.service.heap import AfterIngest

    from .posters import StoreBodies

    config = ServiceConfig()
    directory = KeyDirectory()
    directory.enable_blend_lookup(chunk_size=256, probe_stride=1, engine="cpu")
    makers = [StoreBodies("127.0.0.1", f"alone-{k}", 256, first_id + k * (1 << 36), seed=k) for k in range(posters)]
    after_ingest = AfterIngest(config.gc_freeze_ingest_bytes, config.release_free_heap)  # the service's rule
    gc.collect()
    gc.freeze()
    entries = 0
    cpu = wall = 0.0
    applied, gaps, stop = [0], [], threading.Event()
    runs: list[tuple[float, int]] = []  # (seconds, keys before it) of each run: the events thread's stalls
    if probe:
        threading.Thread(target=_gil_probe, args=(applied, gaps, stop), daemon=True).start()
    warm_until = time.perf_counter() + min(2.0, duration)
    k = 0
    held: bytes | None = None  # a body that did not fit the last run: the next run's first
    while wall < duration:
        run: list[tuple[bytes, None]] = []
        size = 0
        while len(run) < posters:  # what the posters can have queued, within the events thread's bound
            if held is None:
                held = makers[k % posters].next(batch).split(b"\r\n\r\n", 1)[1]
                k += 1
            if run and size + len(held) > MAX_RUN_BYTES:
                break
            run.append((held, None))
            size += len(held)
            held = None
        c0, t0 = time.thread_time(), time.perf_counter()
        for report in decode_and_apply_run(directory, run):
            if isinstance(report, Exception):
                raise report
        after_ingest.note(size)
        if applied[0]:  # (the first run loads or compiles the kernels)
            runs.append((time.perf_counter() - t0, applied[0]))
        applied[0] += batch * len(run)
        if t0 >= warm_until:
            cpu += time.thread_time() - c0
            wall += time.perf_counter() - t0
            entries += batch * len(run)
    stop.set()
    n = max(1, entries)
    return {"stage": "alone", "batch": batch, "posters": posters, "entries_per_s": entries / wall, "errors": 0,
            "loop_us": 0.0, "rest_us": 1e6 * cpu / n, "posters_us": 0.0, "load": os.getloadavg()[0],
            **({"gil_holds": [(round(1e3 * g, 1), keys) for g, keys in sorted(gaps, reverse=True)[:8]],
                "longest_runs": [(round(1e3 * d, 1), keys) for d, keys in sorted(runs, reverse=True)[:8]]}
               if probe else {})}


def _one(stage: str, batch: int, posters: int, duration: float, first_id: int, probe: bool = False) -> dict[str, Any]:
    if stage == "alone":
        import subprocess

        got = subprocess.run([sys.executable, "-m", "blendmatch.bench.floor_stages", "--alone", str(batch),
                              str(posters), str(duration), str(first_id), *(["probe"] if probe else [])],
                             capture_output=True, text=True, timeout=600 + 10 * duration)
        if got.returncode != 0:
            raise RuntimeError(f"stage alone failed: {got.stderr[-2000:]}")
        return json.loads(got.stdout.strip().splitlines()[-1])
    port = free_port()
    cmd = [sys.executable, "-m", "blendmatch.bench.floor_stages", "--serve-stage", stage, "--",
           "--host", "127.0.0.1", "--port", str(port), "--engine", "cpu", "--log-level", "warning"]
    proc, _ = spawn_process(cmd, port)
    try:
        asyncio.run(post_loop("127.0.0.1", port, posters=posters, batch=batch, duration=min(2.0, duration),
                              chunk_size=256, first_id=first_id))  # warm-up
        before, g0 = thread_cpu(proc.pid), os.times()
        r = asyncio.run(post_loop("127.0.0.1", port, posters=posters, batch=batch, duration=duration,
                                  chunk_size=256, first_id=first_id + (1 << 40)))
        after, g1 = thread_cpu(proc.pid), os.times()
    finally:
        stop_server(proc)
    n = max(1, r["entries"])
    return {"stage": stage, "batch": batch, "posters": posters, "entries_per_s": r["entries"] / r["seconds"],
            "errors": r["errors"], "loop_us": 1e6 * (after["loop"] - before["loop"]) / n,
            "rest_us": 1e6 * (after["rest"] - before["rest"]) / n,
            "posters_us": 1e6 * (g1.user + g1.system - g0.user - g0.system) / n, "load": os.getloadavg()[0]}


def measure(batches: Sequence[int], posters: int, duration: float, rounds: int,
            stages: Sequence[str] = STAGES, probe: bool = False) -> list[dict[str, Any]]:
    """Every stage at every batch size, ``rounds`` times, stages alternating within a round;
    ``probe``: stage ``alone`` notes the GIL's longest holds too."""
    rows = []
    for b, batch in enumerate(batches):
        for r in range(rounds):
            for s, stage in enumerate(stages):
                first = ((b * rounds + r) * len(stages) + s + 1) << 44
                rows.append({"round": r, **_one(stage, batch, posters, duration, first, probe)})
                print(f"  {stage} {batch}-entry round {r}: {rows[-1]['entries_per_s']:,.0f} entries/s",
                      file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--alone"]:  # the spawned interpreter of stage alone
        try:
            batch, posters, duration, first_id = int(argv[1]), int(argv[2]), float(argv[3]), int(argv[4])
        except (IndexError, ValueError):
            raise SystemExit("--alone takes BATCH POSTERS DURATION FIRST_ID [probe]") from None
        if batch < 1 or posters < 1 or duration <= 0 or argv[5:] not in ([], ["probe"]):
            raise SystemExit("--alone: BATCH, POSTERS and DURATION must be positive, then at most 'probe'")
        print(json.dumps(_run_alone(batch, posters, duration, first_id, probe=argv[5:] == ["probe"])))
        return 0
    if argv[:1] == ["--serve-stage"]:  # the spawned server
        if len(argv) < 2 or argv[1] not in SERVER_STAGES:
            raise SystemExit(f"--serve-stage takes one of {', '.join(SERVER_STAGES)}")
        return _serve_stage(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.floor_stages",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[64, 1000], metavar="B[,B]")
    p.add_argument("--posters", type=int, default=4)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per stage (after 2 s of warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stages", type=lambda v: v.split(","), default=list(STAGES), metavar="S[,S]")
    p.add_argument("--probe-gil", action="store_true",
                   help="stage alone: a thread asking for the GIL every ms notes its waits over 10 ms (the "
                        "longest holds in one piece, with the keys stored by then)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.posters < 1 or args.duration <= 0 or args.rounds < 1 or min(args.batches) < 1:
        p.error("--posters, --duration, --rounds and every batch must be positive")
    if not set(args.stages) <= set(STAGES):
        p.error(f"--stages takes {', '.join(STAGES)}")
    rows = measure(args.batches, args.posters, args.duration, args.rounds, args.stages, args.probe_gil)
    if args.json:
        print(json.dumps({"stages": rows}))
        return 0
    print("| stage | batch | round | entries/s | server us/entry: loop + rest | posters us/entry | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['batch']} | {r['round']} | {r['entries_per_s']:,.0f} | {r['loop_us']:.1f} + "
              f"{r['rest_us']:.1f} | {r['posters_us']:.1f} | {r['load']:.2f} |")
    for r in rows:
        if "gil_holds" in r:
            holds = ", ".join(f"{ms:g} ms at {keys:,} keys" for ms, keys in r["gil_holds"]) or "none over 10 ms"
            print(f"alone {r['batch']}-entry round {r['round']}: longest GIL holds: {holds}")
            longest = ", ".join(f"{ms:g} ms at {keys:,} keys" for ms, keys in r["longest_runs"])
            print(f"alone {r['batch']}-entry round {r['round']}: longest runs: {longest}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
