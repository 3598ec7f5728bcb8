"""Cold and warm start of ``blendmatch serve``: start-to-ready, and the first STORE and lookup after it.

Question answered: "after ``/readyz`` says ready, does the first request pay a compilation?"
(docs/performance.md, "Cold and warm start"). For a cold compile cache (an empty folder) and then a warm one (the same
folder, filled by the cold run), it starts ``blendmatch serve`` as a real subprocess on a
free loopback port, polls ``/readyz`` until 200 (start-to-ready, from the spawn), then times
the first ``POST /events`` (one STORE of one 256-token LMCache entry), the first blend
lookup in each token form, and the median of the next few of each (the warm times).

Targets: the first STORE and the first lookup within 50 ms of their warm times; a warm
start-to-ready, empty index, under 3 s.

The cache folder is handed over as ``NUMBA_CACHE_DIR`` (which ``blendmatch`` honours), so
``--python`` can point at an interpreter with another blendmatch installed (an A/B against
an older tree). Not a test: figures depend on the machine; print them, compare side by side.

    python -m blendmatch.bench.coldstart [--warm-runs 2] [--python PATH] [--cache DIR] [--chunk-size 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from blendmatch.service.warmup import store_body

_MODEL = "bench/coldstart"
_INSTANCE = "bench-coldstart-mp"


@dataclass
class Run:
    """One server start: seconds to ready, first and warm request times (seconds)."""

    label: str
    ready_s: float = 0.0
    first: dict[str, float] = field(default_factory=dict)
    warm: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(client: httpx.Client, path: str, **kwargs: Any) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    resp = client.post(path, **kwargs)
    return time.perf_counter() - t0, resp


def _requests(client: httpx.Client, chunk_size: int, seq: int, rng: np.random.Generator) -> dict[str, float]:
    """One STORE (seq ``seq``, a new entry), then a lookup of its tokens in each form: times."""
    import base64

    tokens = rng.integers(100_000, 150_000, size=chunk_size, dtype=np.uint32)
    out: dict[str, float] = {}
    took, resp = _timed(client, "/events", content=store_body(tokens, seq=seq, first_hash=seq, chunk_size=chunk_size,
                                                               instance_id=_INSTANCE, model_name=_MODEL),
                        headers={"content-type": "application/json"})
    if resp.status_code != 200 or resp.json().get("applied") != 1:
        raise RuntimeError(f"STORE answered {resp.status_code}: {resp.text[:300]}")
    out["store"] = took
    for form, body in (("lookup token_ids", {"model_name": _MODEL, "token_ids": tokens.tolist()}),
                       ("lookup tokens_b64", {"model_name": _MODEL,
                                              "tokens_b64": base64.b64encode(tokens.astype("<u4").tobytes()).decode()})):
        took, resp = _timed(client, "/directory/blend-lookup", json=body)
        if resp.status_code != 200 or len(resp.json().get("matches", ())) != 1:
            raise RuntimeError(f"{form} answered {resp.status_code}: {resp.text[:300]}")
        out[form] = took
    return out


def one_start(label: str, python: str, cache: str, chunk_size: int, warm_requests: int, timeout: float) -> Run:
    """Start a server with ``cache`` as its compile cache, measure (module docstring), stop it."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("BLENDMATCH_CACHE_DIR",)}
    env["NUMBA_CACHE_DIR"] = cache
    log = tempfile.TemporaryFile()
    cmd = [python, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--chunk-size", str(chunk_size)]
    run = Run(label)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"not ready after {timeout:g} s")
                try:
                    if client.get("/readyz", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            run.ready_s = time.perf_counter() - t0
            rng = np.random.default_rng(45)
            run.first = _requests(client, chunk_size, 1, rng)
            later = [_requests(client, chunk_size, 2 + i, rng) for i in range(warm_requests)]
            run.warm = {k: statistics.median(r[k] for r in later) for k in run.first}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        run.log_tail = log.read().decode(errors="replace")[-4000:]
        log.close()
    return run


def _report(runs: list[Run]) -> None:
    kinds = list(runs[0].first)
    print(f"{'start':<12} {'ready s':>8}  " + "  ".join(f"{k + ' first/warm ms':>30}" for k in kinds))
    for r in runs:
        cells = [f"{r.first[k] * 1e3:>12.1f} / {r.warm[k] * 1e3:>7.1f} (+{(r.first[k] - r.warm[k]) * 1e3:.0f})"
                 for k in kinds]
        print(f"{r.label:<12} {r.ready_s:>8.2f}  " + "  ".join(f"{c:>30}" for c in cells))
    worst = max(r.first[k] - r.warm[k] for r in runs for k in kinds)
    warm_ready = [r.ready_s for r in runs if r.label.startswith("warm")]
    print(f"target: first request within 50 ms of warm: worst +{worst * 1e3:.0f} ms "
          f"({'met' if worst <= 0.05 else 'NOT met'})")
    if warm_ready:
        print(f"target: warm start-to-ready < 3 s: median {statistics.median(warm_ready):.2f} s "
              f"({'met' if statistics.median(warm_ready) < 3 else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.coldstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="interpreter that runs blendmatch serve (default: this one)")
    p.add_argument("--warm-runs", type=int, default=2, help="starts with the filled cache (default %(default)s)")
    p.add_argument("--warm-requests", type=int, default=5, help="requests whose median is the warm time")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take to be ready")
    p.add_argument("--show-log", action="store_true", help="print the tail of each server's log")
    p.add_argument("--cache", default="", metavar="DIR",
                   help="numba's cache folder to use and keep (default: a new empty one, removed after); a filled "
                        "one makes the first start warm too (A/B runs of two trees, each with its own folder)")
    args = p.parse_args(argv)
    folder = args.cache or tempfile.mkdtemp(prefix="blendmatch-coldstart-")
    cache = args.cache or os.path.join(folder, "numba")
    filled = bool(args.cache) and os.path.isdir(cache) and bool(os.listdir(cache))
    print(f"serving with {args.python}; compile cache {cache} ({'filled' if filled else 'empty at first'}); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: list[Run] = []
    try:
        for i in range(1 + args.warm_runs):
            label = ("warm 0" if filled else "cold") if i == 0 else f"warm {i}"
            run = one_start(label, args.python, cache, args.chunk_size, args.warm_requests, args.timeout)
            runs.append(run)
            print(f"  {label}: ready after {run.ready_s:.2f} s; first STORE {run.first['store'] * 1e3:.1f} ms",
                  flush=True)
            if args.show_log:
                print(run.log_tail)
    finally:
        if not args.cache:
            shutil.rmtree(folder, ignore_errors=True)
    _report(runs)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
