"""Loopback servers for the client tests: the real app under uvicorn, and a scripted HTTP
server whose every answer (and delay, and silence) the test decides."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import uvicorn

#: ``(method, path, body) -> (status, raw body) | None``; ``None`` means never answer.
Script = Callable[[str, str, Any], "tuple[int, bytes] | None"]


class LoopbackApp:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a daemon thread; ``with`` -> URL."""

    def __init__(self, app: Any) -> None:
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for
        # sockets that say they are TCP; without it every answer waits ~40 ms for a delayed ACK.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class ScriptedServer:
    """A threaded HTTP/1.1 server on a free loopback port that answers as ``script`` says.

    ``requests`` lists ``(method, path, body)`` in arrival order; ``answered`` counts the
    responses written. A handler told to stay silent holds its connection until ``close``.
    """

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[str, str, Any]] = []
        self.answered = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stall

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _handle(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                with outer._lock:
                    outer.requests.append((self.command, self.path, body))
                reply = outer.script(self.command, self.path, body)
                if reply is None:
                    outer.stopping.wait(30)
                    self.close_connection = True
                    return
                status, payload = reply
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                with outer._lock:
                    outer.answered += 1

            do_GET = do_POST = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def paths(self) -> list[str]:
        with self._lock:
            return [p for _, p, _ in self.requests]

    def __enter__(self) -> "ScriptedServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def json_reply(obj: Any, status: int = 200) -> tuple[int, bytes]:
    return status, json.dumps(obj).encode()


def refused_url() -> str:
    """A loopback URL where nothing listens (the port was just free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` every millisecond until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
