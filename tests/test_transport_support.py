"""The start-up check of uvicorn's private surface (service/transport_support.py) and the
fallback to plain uvicorn when something is missing.

The fallback is tested as an operator meets it: ``blendmatch serve`` in a subprocess whose
uvicorn lacks one internal (deleted before the CLI starts), asked over a real socket for
events, lookups and a bad request; it must answer them rightly and say once, at WARNING,
what is missing.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from blendmatch.service.config import ServiceConfig
from blendmatch.service.transport_support import fallback_uvicorn_options, transport_support

from service_support import C, MODEL, b64, chunks, events, hash_of, store
from test_http_limits import read_response


def test_the_installed_uvicorn_has_everything():
    assert transport_support() == []


@pytest.mark.parametrize("owner, name, expect", [
    ("HttpToolsProtocol", "_start_asgi_task", "HttpToolsProtocol._start_asgi_task"),
    ("HttpToolsProtocol", "send_400_response", "HttpToolsProtocol.send_400_response"),
    ("module", "STATUS_LINE", "httptools_impl.STATUS_LINE[200]"),
    ("module", "RequestResponseCycle", "httptools_impl.RequestResponseCycle"),
])
def test_a_missing_internal_is_named(monkeypatch, owner, name, expect):
    from uvicorn.protocols.http import httptools_impl

    monkeypatch.delattr(httptools_impl if owner == "module" else httptools_impl.HttpToolsProtocol, name)
    assert expect in transport_support()


def test_a_changed_call_structure_is_named(monkeypatch):
    """uvicorn 0.44 started a request's task inline in ``on_headers_complete``: the limits'
    override of ``_start_asgi_task`` never saw it (the lane's test hung)."""
    from uvicorn.protocols.http import httptools_impl

    def on_headers_complete(self):  # a stand-in that starts nothing through _start_asgi_task
        self.cycle = None

    monkeypatch.setattr(httptools_impl.HttpToolsProtocol, "on_headers_complete", on_headers_complete)
    assert transport_support() == ["HttpToolsProtocol.on_headers_complete calling _start_asgi_task",
                                   "HttpToolsProtocol.on_headers_complete calling RequestResponseCycle"]


def test_per_connection_state_is_checked(monkeypatch):
    from uvicorn.protocols.http import httptools_impl

    begin = httptools_impl.HttpToolsProtocol.on_message_begin

    def without_url(self):
        begin(self)
        del self.url

    monkeypatch.setattr(httptools_impl.HttpToolsProtocol, "on_message_begin", without_url)
    assert transport_support() == ["HttpToolsProtocol().url"]


def test_the_fallback_keeps_what_public_options_can():
    cfg = ServiceConfig(max_header_bytes=4096, max_connections=7)
    assert fallback_uvicorn_options(cfg) == {"http": "h11", "h11_max_incomplete_event_size": 4096,
                                             "limit_concurrency": 7}


_WITHOUT = ("import sys\nimport uvicorn.protocols.http.httptools_impl as impl\n"
            "del impl.HttpToolsProtocol._start_asgi_task\n"
            "from blendmatch.service.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def _post(path: bytes, body: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


def test_serve_falls_back_to_plain_uvicorn_with_one_warning():
    from test_durability_service import ROOT, _free_port

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _WITHOUT, "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--engine", "cpu", "--chunk-size", str(C), "--log-level", "warning",
                             "--max-header-bytes", "2048"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = chunks(4, seed=21)

    def ask(raw: bytes) -> tuple[int, dict[str, str], bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            return read_response(s)

    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "blendmatch serve did not open its port"
                time.sleep(0.05)
        # the port opens before the kernels are compiled: /readyz says "compiling" until then
        while ask(b"GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline + 120, "blendmatch serve never became ready"
            time.sleep(0.1)
        status, _, body = ask(_post(b"/events", json.dumps(events(store("inst-a", 1, rows))).encode()))
        assert status == 200 and json.loads(body)["applied"] == 1
        other = np.arange(60_000, 60_040, dtype=np.uint32)
        query = np.concatenate([other[:7], rows[2], other[7:]])
        for _ in range(3):  # kept-alive and fresh connections alike
            status, headers, body = ask(_post(b"/directory/blend-lookup", json.dumps(
                {"tokens_b64": b64(query), "model_name": MODEL}).encode()))
            assert (status, headers["content-type"]) == (200, "application/json")
            assert json.loads(body)["matches"] == [{"chunk_hash": hash_of(2).hex(), "old_st": 2 * C, "cur_st": 7}]
        status, _, body = ask(_post(b"/directory/blend-lookup", b'{"tokens_b64": "@@@@", "model_name": "m"}'))
        assert status == 422 and "tokens_b64" in json.loads(body)["detail"]
        # --max-header-bytes is kept (h11's bound on a head still incomplete): a header that
        # goes on is refused, never buffered whole
        status, _, _ = ask(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 8192)
        assert status == 400
        assert ask(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 200
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    warnings = [line for line in stderr.splitlines() if "lacks what the HTTP limits" in line]
    assert len(warnings) == 1, stderr[-3000:]
    assert "HttpToolsProtocol._start_asgi_task" in warnings[0] and "WARNING" in warnings[0]
    assert "Traceback" not in stderr, stderr[-3000:]
