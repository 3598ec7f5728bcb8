"""The load generator of ``blendmatch loadtest``: the server process, a raw HTTP client, the loops.

Split out of ``loadtest.py`` (which keeps the workload, the phases, the table and the CLI)
so that each stays small. What is here knows nothing of blendmatch's API beyond
``blendmatch serve`` and ``GET /healthz``: it starts and stops a server, sends pre-encoded
HTTP/1.1 requests on keep-alive connections (:class:`Conn`, not httpx: on a 2-core machine
the generator must cost far less CPU per request than the server), runs closed loops of
them in Python (:func:`closed_loop`) or in wrk (:func:`wrk_loop`), and reads a process's
CPU time from ``/proc`` (:func:`proc_cpu_s`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["Conn", "WRK_LUA", "closed_loop", "free_port", "get_request", "percentile_ms", "post_request",
           "proc_cpu_s", "request_parts", "spawn_process", "spawn_server", "stop_server", "wrk_available", "wrk_loop"]


# ---------------------------------------------------------------------- server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_server(args: Sequence[str], *, log_path: str | os.PathLike | None = None,
                 timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start ``blendmatch serve --host 127.0.0.1 --port <free> *args``; wait for /healthz.

    Returns ``(process, base_url)``. Output goes to ``log_path`` (or is discarded). Raises
    ``RuntimeError`` with the log's tail if the server exits or does not answer in time.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    return spawn_process(cmd, port, log_path=log_path, timeout=timeout)


def spawn_process(cmd: Sequence[str], port: int, *, log_path: str | os.PathLike | None = None,
                  timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start ``cmd``, a server that will listen on ``127.0.0.1:port``, and wait for its
    ``GET /healthz`` (blendmatch's or LMCache's coordinator: ``loadtest --vs-lmcache``),
    then, for blendmatch, until its ``/readyz`` no longer says ``compiling`` (requests
    answer 503 until then)."""
    if log_path is not None:
        with open(log_path, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if _get(port, "/healthz").startswith(b"HTTP/1.1 200") and b'"compiling"' not in _get(port, "/readyz"):
                return proc, url
        except OSError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    tail = Path(log_path).read_text(errors="replace")[-2000:] if log_path is not None else ""
    raise RuntimeError(f"server did not come up ({' '.join(cmd)}):\n{tail}")


def _get(port: int, path: str) -> bytes:
    """The whole response to ``GET path`` (``Connection: close``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
        got = b""
        while True:
            piece = s.recv(4096)
            if not piece:
                return got
            got += piece


def stop_server(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL after ``timeout``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


# ---------------------------------------------------------------------- raw HTTP client
class Conn:
    """One keep-alive HTTP/1.1 connection; requests are pre-encoded bytes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> "Conn":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            await self.open()
        assert self.writer is not None and self.reader is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        i = lower.find(b"content-length:")
        if i < 0:
            raise RuntimeError(f"response without content-length: {head[:200]!r}")
        n = int(lower[i + 15:lower.index(b"\r\n", i)])
        body = await self.reader.readexactly(n) if n else b""
        if b"connection: close" in lower:
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


def post_request(host: str, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def get_request(host: str, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


# ---------------------------------------------------------------------- load generators
async def closed_loop(host: str, port: int, requests: list[bytes], clients: int, duration: float,
                       max_requests: int, check: Any = None) -> tuple[list[float], int, float]:
    """``clients`` connections, each sending requests back to back until time or count runs
    out. Returns (latencies in s, errors, wall seconds)."""
    latencies: list[float] = []
    errors = 0
    budget = [max_requests]
    conns = [await Conn(host, port).open() for _ in range(clients)]
    t_end = time.perf_counter() + duration

    async def one(ci: int) -> None:
        nonlocal errors
        conn = conns[ci]
        k = ci
        n = len(requests)
        while time.perf_counter() < t_end and budget[0] > 0:
            budget[0] -= 1
            raw = requests[k % n]
            k += clients
            t0 = time.perf_counter()
            try:
                status, body = await conn.request(raw)
            except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError):
                errors += 1
                await conn.close()
                continue
            latencies.append(time.perf_counter() - t0)
            if status != 200 or (check is not None and not check(body)):
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    for c in conns:
        await c.close()
    return latencies, errors, wall


def percentile_ms(lat: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(lat), q) * 1e3) if lat else float("nan")


WRK_LUA = r"""
-- generated by blendmatch loadtest: one pre-built request per body line, rotating
local threads = {}
function setup(thread) thread:set("tid", #threads); table.insert(threads, thread) end
function init(args)
  requests = {}
  local method = args[2]
  for line in io.lines(args[1]) do
    if #line > 0 then
      if method == "GET" then requests[#requests + 1] = wrk.format("GET", args[3])
      else requests[#requests + 1] = wrk.format("POST", args[3], {["Content-Type"] = "application/json"}, line) end
    end
  end
  idx = tid % #requests
end
function request() idx = idx % #requests + 1; return requests[idx] end
function response(status, headers, body) if status ~= 200 then bad = (bad or 0) + 1 end end
function done(s, lat, r)
  local b = 0
  for _, t in ipairs(threads) do b = b + (t:get("bad") or 0) end
  io.write(string.format('WRKJSON {"requests": %d, "seconds": %.6f, "p50_us": %d, "p99_us": %d, "p999_us": %d, ' ..
    '"max_us": %d, "non200": %d, "socket_errors": %d}\n', s.requests, s.duration / 1e6, lat:percentile(50),
    lat:percentile(99), lat:percentile(99.9), lat.max, b,
    s.errors.connect + s.errors.read + s.errors.write + s.errors.timeout))
end
"""


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def request_parts(raw: bytes) -> tuple[str, str, bytes]:
    """(method, path, body) of a pre-encoded request."""
    head, _, body = raw.partition(b"\r\n\r\n")
    method, path, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
    return method.decode(), path.decode(), body


async def wrk_loop(host: str, port: int, requests: list[bytes], clients: int,
                    duration: float) -> tuple[dict[str, Any], float]:
    """Run wrk (one thread, ``clients`` connections) over ``requests``; (its JSON, wall s)."""
    method, path, _ = request_parts(requests[0])
    with tempfile.TemporaryDirectory(prefix="blendmatch-wrk-") as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        with open(bodies, "wb") as f:
            for raw in requests:
                body = request_parts(raw)[2] or b"-"
                if b"\n" in body:
                    raise ValueError("wrk bodies must be one line each")
                f.write(body + b"\n")
        script = Path(tmp) / "bodies.lua"
        script.write_text(WRK_LUA)
        cmd = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(duration))}s", "--timeout", "5s", "-s", str(script),
               f"http://{host}:{port}", "--", str(bodies), method, path]
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        wall = time.perf_counter() - t0
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[8:]), wall
    raise RuntimeError(f"wrk printed no result (rc {proc.returncode}): {out[-500:]!r} {err[-500:]!r}")


def machine_ticks() -> tuple[int, int] | None:
    """``(idle, total)`` clock ticks of the whole machine since boot (``/proc/stat``'s first
    line; idle includes iowait). Two readings give the cores left idle over a phase
    (:func:`idle_cores`): whether the 2 vCPUs, not a serial stage of the server, set the rate."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return ticks[3] + ticks[4], sum(ticks[:8])  # idle + iowait; user..steal (guest is in user)


def idle_cores(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The machine's idle cores on average between two :func:`machine_ticks` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def proc_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
