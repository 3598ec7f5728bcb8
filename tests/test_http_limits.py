"""HTTP limits over raw loopback sockets (service/limits.py): header bytes (431), header and
body read timeouts (408), the connection limit (503), the global bound on bytes in flight
(503 / abort), and JSON 400s for requests the HTTP parser rejects.

Each test runs the real app under uvicorn with the protocol ``blendmatch serve`` gives it,
on a free 127.0.0.1 port, with small limits and timeouts so that nothing waits long; every
wait is bounded by a socket timeout or a polling deadline of a few seconds.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from typing import Any

import pytest
import uvicorn

from blendmatch.service.app import create_app
from blendmatch.service.limits import HttpLimits

from service_support import b64, config, served


class Served:
    """The app under uvicorn with ``HttpLimits`` from ``cfg`` (as ``blendmatch serve`` runs it;
    ``cli_uvicorn``: also uvicorn's other settings as the CLI gives them, no proxy headers and
    no access log, under which the lookup lane runs: ``tests/test_lane.py``; ``fast_path``:
    ``create_app``'s)."""

    def __init__(self, *, cli_uvicorn: bool = False, fast_path: bool = True, **overrides: Any) -> None:
        self.cfg = config(**overrides)
        self.app = app = create_app(self.cfg, fast_path=fast_path)
        metrics = app.state.blendmatch_context.metrics
        self.limits = HttpLimits.from_config(self.cfg, registry=metrics.registry,
                                             on_reject=lambda status: metrics.rejected.labels(str(status)).inc())
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        cli = ({"proxy_headers": False, "access_log": False, "timeout_keep_alive": self.cfg.timeout_keep_alive}
               if cli_uvicorn else {})
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    http=self.limits.protocol_class, **cli))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def connect(self, timeout: float = 5.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return s

    def request(self, raw: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        with self.connect(timeout) as s:
            s.sendall(raw)
            return read_response(s)

    def metric(self, name: str, labels: str = "") -> float:
        _, _, body = self.request(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", body.decode(), re.M)
        return float(m.group(1)) if m else float("nan")

    def wait_until(self, what: str, cond: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
            time.sleep(0.02)


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length framed); raises on EOF before it is complete."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        if not got:
            raise ConnectionError(f"closed after {buf!r}")
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        got = s.recv(65536)
        if not got:
            raise ConnectionError("closed mid-body")
        rest += got
    return status, headers, rest[:n]


def closed_by_peer(s: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset) before the socket timeout."""
    try:
        while True:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def json_detail(status: int, headers: dict[str, str], body: bytes) -> str:
    assert headers.get("content-type") == "application/json", (status, headers, body)
    return json.loads(body)["detail"]


# ---------------------------------------------------------------------------------------------- 5


def test_header_over_the_limit_is_431_while_reading_and_the_server_stays_healthy():
    with Served(max_header_bytes=4096) as srv:
        with srv.connect() as s:
            # 4 MB of one header line: never buffered whole, answered as soon as 4 KiB are in
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")
            try:
                for _ in range(64):
                    s.sendall(b"a" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed while we were still sending
            status, headers, body = read_response(s)
        assert status == 431
        assert "--max-header-bytes" in json_detail(status, headers, body)
        assert headers["connection"] == "close"
        # under the limit is served; the refusal was counted
        status, _, body = srv.request(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Small: " + b"a" * 2000 + b"\r\n\r\n")
        assert (status, body) == (200, b'{"status":"healthy"}')
        assert srv.metric("blendmatch_http_limit_rejections_total", '{limit="header_bytes"}') == 1
        assert srv.metric("blendmatch_http_rejected_total", '{status="431"}') == 1


# ---------------------------------------------------------------------------------------------- 6


def test_silent_connection_is_closed_after_the_header_timeout():
    with Served(header_timeout=0.3) as srv:
        with srv.connect(timeout=5) as s:
            t0 = time.monotonic()
            assert closed_by_peer(s)
            assert time.monotonic() - t0 < 3
        assert srv.metric("blendmatch_http_limit_rejections_total", '{limit="header_timeout"}') == 1


def test_partial_headers_get_408_and_close(caplog):
    caplog.set_level(logging.WARNING, logger="blendmatch.service.limits")
    with Served(header_timeout=0.3) as srv:
        with srv.connect() as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # never the blank line
            status, headers, body = read_response(s)
            assert status == 408
            assert "--header-timeout" in json_detail(status, headers, body)
            assert closed_by_peer(s)
    assert "408 request headers not received within 0.3 s" in caplog.text


def test_trickled_body_gets_408_after_the_body_timeout_in_total():
    with Served(body_timeout=0.5, header_timeout=5) as srv:
        with srv.connect() as s:
            s.sendall(b"POST /directory/blend-lookup HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            # one byte every 0.1 s: each read is quick, the body never ends
            t0 = time.monotonic()
            s.settimeout(0.1)
            got = b""
            while time.monotonic() - t0 < 4 and b"\r\n\r\n" not in got:
                try:
                    s.sendall(b" ")
                    got += s.recv(65536)
                except socket.timeout:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
            assert got.startswith(b"HTTP/1.1 408 "), got
            assert b"--body-timeout" in got


def test_connection_limit_refuses_with_503_counts_and_logs(caplog):
    caplog.set_level(logging.WARNING, logger="blendmatch.service.limits")
    with Served(max_connections=3, header_timeout=30) as srv:
        held = [srv.connect() for _ in range(3)]
        srv.wait_until("3 connections open", lambda: len(srv.limits.open) == 3)
        with srv.connect() as s:
            status, headers, body = read_response(s)  # answered without sending anything
            assert status == 503
            assert "--max-connections" in json_detail(status, headers, body)
            assert closed_by_peer(s)
        held.pop().close()
        srv.wait_until("a slot freed", lambda: len(srv.limits.open) == 2)
        assert srv.metric("blendmatch_http_limit_rejections_total", '{limit="connections"}') == 1
        for h in held:
            h.close()
    assert "refused a connection: 3 open (--max-connections)" in caplog.text


# ---------------------------------------------------------------------------------------------- 7


def _partial_post(srv: Served, declared: int, sent: int) -> socket.socket:
    s = srv.connect()
    s.sendall(b"POST /events HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % declared + b"[" * sent)
    return s


def test_bodies_in_flight_are_bounded_across_connections():
    kib = 1024
    with Served(max_bytes_in_flight=256 * kib, max_body_bytes=200 * kib, body_timeout=30) as srv:
        a = _partial_post(srv, 150 * kib, 100 * kib)
        b = _partial_post(srv, 150 * kib, 100 * kib)
        srv.wait_until("200 KiB held", lambda: srv.limits.in_flight >= 200 * kib)
        c = _partial_post(srv, 150 * kib, 100 * kib)  # crosses 256 KiB: refused, its bytes released
        status, headers, body = read_response(c)
        assert status == 503
        assert "--max-bytes-in-flight" in json_detail(status, headers, body)
        c.close()
        assert srv.limits.in_flight <= 256 * kib
        a.close()
        b.close()
        srv.wait_until("all released", lambda: srv.limits.in_flight == 0)
        # and the server takes full bodies again
        status, _, body = srv.request(b"POST /events HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: 2\r\n\r\n[]")
        assert status == 422, body  # a schema error: it was read and parsed
        assert srv.metric("blendmatch_http_limit_rejections_total", '{limit="bytes_in_flight"}') == 1


def test_a_client_not_reading_its_pipelined_responses_is_aborted():
    kib = 1024
    with Served(max_bytes_in_flight=64 * kib, max_body_bytes=16 * kib) as srv:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", srv.port))
        one = b"GET /openapi.json HTTP/1.1\r\nHost: t\r\n\r\n"
        try:
            s.sendall(one * 400)  # ~20 MB of answers, none read
        except (BrokenPipeError, ConnectionResetError):
            pass
        srv.wait_until("the connection aborted", lambda: srv.limits.refusals["bytes_in_flight"] >= 1, timeout=10)
        srv.wait_until("its bytes released", lambda: srv.limits.in_flight == 0)
        assert closed_by_peer(s)
        s.close()
        status, _, _ = srv.request(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status == 200


# --------------------------------------------------------------------------------------------- 12


@pytest.mark.parametrize("value", [b"abc", b"-1", b"1e3", b"99999999999999999999999", b"5, 6"])
def test_bad_content_length_gets_the_json_400(value):
    with Served() as srv:
        status, headers, body = srv.request(b"POST /directory/blend-lookup HTTP/1.1\r\nHost: t\r\n"
                                            b"Content-Type: application/json\r\nContent-Length: " + value +
                                            b"\r\n\r\n{}")
        assert status == 400
        assert "malformed HTTP request" in json_detail(status, headers, body)


def test_two_content_lengths_get_the_json_400():
    with Served() as srv:
        status, headers, body = srv.request(b"POST /events HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                            b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n[]")
        assert status == 400
        assert "malformed HTTP request" in json_detail(status, headers, body)


_BIG = "9" * 5000  # over Python's 4,300-digit limit on int(str)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("path,body", [
    ("/directory/blend-lookup", '{"model_name":"m","world_size":%s,"cache_salt":"","token_ids":[1]}' % _BIG),
    ("/directory/blend-lookup", '{"model_name":"m","world_size":1,"cache_salt":"","token_ids":[1,%s]}' % _BIG),
    ("/directory/blend-lookup/batch",
     '{"queries":[{"model_name":"m","world_size":1,"cache_salt":"","token_ids":[%s]}]}' % _BIG),
    ("/directory/lookup", '{"keys":[],"x":%s}' % _BIG),
    ("/instances", '{"instance_id":"a","host":"h","port":%s}' % _BIG),
], ids=["world_size", "token_id", "batch_token_id", "keys_lookup", "instances"])
async def test_integers_of_thousands_of_digits_are_a_plain_422(path, body):
    async with served() as (client, _):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert "number out of range" in detail
    assert "set_int_max_str_digits" not in r.text and "4300 digits" in detail


@pytest.mark.anyio
@pytest.mark.parametrize("ctrl", ["\n", "\t", "\r", "\x00"])
async def test_raw_control_character_in_tokens_b64_gets_the_routes_answer(ctrl):
    v = b64(list(range(32)))
    fast = '{"tokens_b64":"%s%s%s","model_name":"m","world_size":1,"cache_salt":""}' % (v[:8], ctrl, v[8:])
    routed = '{"model_name":"m","world_size":1,"cache_salt":"","tokens_b64":"%s%s%s"}' % (v[:8], ctrl, v[8:])
    async with served() as (client, _):
        answers = [await client.post("/directory/blend-lookup", content=body,
                                     headers={"content-type": "application/json"}) for body in (fast, routed)]
    for r in answers:
        assert r.status_code == 422
        assert "JSON decode error: Invalid control character" in r.json()["detail"], r.text


# ------------------------------------------------------------------------------- blendmatch serve


def test_blendmatch_serve_applies_the_limit_flags():
    """The same protocol through the CLI (the flags reach it): 431, a silent connection
    closed, and the counter in /metrics."""
    import subprocess
    import sys

    from test_durability_service import ROOT, _free_port

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--engine", "cpu", "--chunk-size", "16", "--log-level", "warning",
                             "--max-header-bytes", "2048", "--header-timeout", "0.5"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "blendmatch serve did not open its port"
                time.sleep(0.05)
        with s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
            status, headers, body = read_response(s)
        assert status == 431 and "--max-header-bytes" in json_detail(status, headers, body)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert closed_by_peer(s)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            _, _, metrics = read_response(s)
        assert 'blendmatch_http_limit_rejections_total{limit="header_bytes"} 1.0' in metrics.decode()
        assert 'blendmatch_http_limit_rejections_total{limit="header_timeout"} 1.0' in metrics.decode()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.anyio
async def test_distinct_instance_ids_are_bounded_and_stats_stay_bounded():
    from service_support import chunks, store

    async with served(config(max_instances=5)) as (client, _):
        for i in range(5):
            r = await client.post("/events", json={"batches": [store(f"inst-{i}", 1, chunks(1, seed=i), first_hash=i)]})
            assert r.status_code == 200 and r.json()["applied"] == 1
        # a sixth id, even beside a known one: 429, nothing of the request applied
        r = await client.post("/events", json={"batches": [store("inst-0", 2, chunks(1, seed=10), first_hash=10),
                                                           store("inst-new", 1, chunks(1, seed=11), first_hash=11)]})
        assert r.status_code == 429
        assert "--max-instances" in r.json()["detail"] and "nothing was applied" in r.json()["detail"]
        stats = (await client.get("/directory/stats")).json()
        assert len(stats["blendmatch"]["instances"]) == 5 and stats["num_keys"] == 5
        # known ids go on
        r = await client.post("/events", json={"batches": [store("inst-0", 2, chunks(1, seed=10), first_hash=10)]})
        assert r.status_code == 200 and r.json()["applied"] == 1
        # registrations are bounded the same way
        for i in range(5):
            r = await client.post("/instances", json={"instance_id": f"mp-{i}", "ip": "10.0.0.1", "http_port": 8000})
            assert r.status_code == 200, r.text
        r = await client.post("/instances", json={"instance_id": "mp-5", "ip": "10.0.0.1", "http_port": 8000})
        assert r.status_code == 429 and "--max-instances" in r.json()["detail"]
        r = await client.post("/instances", json={"instance_id": "mp-0", "ip": "10.0.0.1", "http_port": 8000})
        assert r.status_code == 200 and r.json()["re_registered"]


def test_a_client_gone_while_its_pipelined_responses_are_written_is_no_error(caplog):
    """uvicorn marks only the newest pipelined request disconnected; the one being answered
    went on writing to the closed transport, and uvloop's RuntimeError came out as an ERROR
    with a traceback per connection."""
    import struct

    caplog.set_level(logging.INFO)
    with Served() as srv:
        for _ in range(3):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.settimeout(5)
            s.connect(("127.0.0.1", srv.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            s.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: t\r\n\r\n" * 300)
            s.recv(5000)
            time.sleep(0.05)
            s.recv(5000)
            s.close()
        time.sleep(0.5)
        status, _, _ = srv.request(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_an_idle_kept_alive_connection_closes_after_the_keep_alive_timeout(monkeypatch):
    """Keep-alive (limits.py keeps it as a deadline the tick checks, not a timer per
    response): a connection that keeps talking stays open, a request still being answered
    when the last response's deadline passes is not cut, and an idle connection is closed
    once ``--timeout-keep-alive`` has passed (within a tick, here 0.1 s)."""
    from blendmatch.service.context import ServiceContext

    run = ServiceContext._run_lookups
    monkeypatch.setattr(ServiceContext, "_run_lookups", lambda self, queries: time.sleep(0.6) or run(self, queries))
    lookup = json.dumps({"tokens_b64": b64(list(range(20))), "model_name": "m"}).encode()
    with Served(cli_uvicorn=True, timeout_keep_alive=0.6, header_timeout=0.4, body_timeout=0.4) as srv:
        assert srv.limits.tick_s == pytest.approx(0.1)
        with srv.connect() as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert _read_answer(s).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.3)  # then a lookup that takes 0.6 s: the healthz answer's deadline passes meanwhile
            s.sendall(b"POST /directory/blend-lookup HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(lookup), lookup))
            assert _read_answer(s).startswith(b"HTTP/1.1 200 ")
            for _ in range(6):  # 1.8 s of requests 0.3 s apart, each within the timeout of the last
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                assert _read_answer(s).startswith(b"HTTP/1.1 200 ")
                time.sleep(0.3)
            idle_from = time.monotonic()
            s.settimeout(10)
            assert s.recv(100) == b""  # the server closed it
            assert time.monotonic() - idle_from >= 0.6 - 0.3 - 0.05  # not before the timeout (0.3 s slept already)


def _read_answer(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(4096)
        assert got, data
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    n = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < n:
        rest += s.recv(4096)
    return head


def test_refusals_and_operations_bodies_have_the_one_json_encoding():
    """Every JSON body the service writes itself is ``http_rules.json_body``'s bytes: the
    limits' refusals and the operations routes used to encode their own (with spaces)."""
    from blendmatch.service.http_rules import json_body

    with Served(max_header_bytes=1024) as srv:
        with srv.connect() as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 2048 + b"\r\n\r\n")
            status, headers, body = read_response(s)
        assert status == 431 and body == json_body({"detail": json_detail(status, headers, body)})
        status, headers, body = srv.request(b"GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status == 200 and body == json_body({"status": "ready"}) == b'{"status":"ready"}'
        status, headers, body = srv.request(b"POST /admin/checkpoint HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        assert status == 409 and body == json_body({"detail": json_detail(status, headers, body)})
