"""The transport floor of ``POST /events`` ingest on this machine (docs/performance.md, "Where ingest's time goes").

Question answered: "how many entries per second could one server take over HTTP if parsing
and applying cost nothing, with the same posters on the same cores?" A bare HTTP/1.1 server
(asyncio protocol on uvloop when installed, ``TCP_NODELAY``) reads each body whole by its
``Content-Length`` and answers a fixed 200 JSON; ``loadtest``'s own posters
(``posters.post_loop``: 4 connections, back to back, every entry a new chunk) drive it at
each batch size. Printed per batch size: entries/s, and the bare server's and the posters'
CPU per entry (user and system), beside which ``blendmatch loadtest``'s ingest rows read what
blendmatch itself costs (docs/performance.md, "Where ingest's time goes").

Run: ``python -m blendmatch.bench.floor [--batches 64,1000] [--posters 4] [--duration 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
from typing import Any

from .posters import post_loop

__all__ = ["REPLY", "main", "measure", "serve_bare"]

REPLY = b'{"applied":1,"duplicates":0,"stale":0,"entries_applied":0,"entries_not_indexable":0}'


class _Bare(asyncio.Protocol):
    """Reads requests by Content-Length (one copy of each body, as a server would hold it)
    and answers each with ``reply``, a JSON body."""

    reply = REPLY

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = bytearray()
        self.need: int | None = None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end]).lower()
                at = head.find(b"content-length:")
                length = int(head[at + 15:].split(b"\r\n")[0]) if at >= 0 else 0
                self.need = end + 4 + length
            if len(self.buf) < self.need:
                return
            body = bytes(self.buf[:self.need])  # noqa: F841 - the copy a server makes
            del self.buf[:self.need]
            self.need = None
            reply = self.reply
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(reply), reply))


def serve_bare(port: int, ready: Any, reply: bytes = REPLY) -> None:  # pragma: no cover - a child process
    """The bare server on ``127.0.0.1:port`` answering every request with ``reply``; sets
    ``ready`` (a multiprocessing event) once listening. Run it in a process of its own."""
    proto = type("Bare", (_Bare,), {"reply": reply})

    async def run() -> None:
        await asyncio.get_running_loop().create_server(proto, "127.0.0.1", port)
        ready.set()
        await asyncio.Event().wait()

    try:
        import uvloop
        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


def _cpu(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def measure(batches: list[int], posters: int, duration: float) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=serve_bare, args=(port, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the bare server did not start")
        rows = []
        for k, batch in enumerate(batches):
            asyncio.run(post_loop("127.0.0.1", port, posters=posters, batch=batch, duration=min(1.0, duration),
                                  chunk_size=256, first_id=(2 * k + 1) << 44))  # warm-up
            u0, s0 = _cpu(proc.pid)
            g0 = os.times()
            r = asyncio.run(post_loop("127.0.0.1", port, posters=posters, batch=batch, duration=duration,
                                      chunk_size=256, first_id=(2 * k + 2) << 44))
            u1, s1 = _cpu(proc.pid)
            g1 = os.times()
            n = max(1, r["entries"])
            rows.append({"batch": batch, "posters": posters, "entries_per_s": r["entries"] / r["seconds"],
                         "errors": r["errors"],
                         "server_user_us": 1e6 * (u1 - u0) / n, "server_sys_us": 1e6 * (s1 - s0) / n,
                         "posters_user_us": 1e6 * (g1.user - g0.user) / n,
                         "posters_sys_us": 1e6 * (g1.system - g0.system) / n,
                         "load": os.getloadavg()[0]})
        return rows
    finally:
        proc.terminate()
        proc.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.floor", description=__doc__.split("\n\n")[1])
    p.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[64, 1000], metavar="B[,B]")
    p.add_argument("--posters", type=int, default=4)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per batch size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.posters < 1 or args.duration <= 0 or min(args.batches) < 1:
        p.error("--posters, --duration and every batch must be positive")
    rows = measure(args.batches, args.posters, args.duration)
    if args.json:
        print(json.dumps({"floor": rows}))
        return 0
    print("| batch | posters | entries/s (bare server) | bare server us/entry (user + sys) | posters us/entry (user + sys) | load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['posters']} | {r['entries_per_s']:,.0f} | {r['server_user_us']:.2f} + "
              f"{r['server_sys_us']:.2f} | {r['posters_user_us']:.2f} + {r['posters_sys_us']:.2f} | {r['load']:.2f} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
