"""End to end over a real loopback socket: uvicorn in a thread, and the CLI in a subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from blendmatch.index.types import BlendMatch, BlendNamespace
from blendmatch.service.app import create_app
from blendmatch.service.client import BlendClient, BlendHTTPError, resolve_overlaps
from blendmatch.bench.loadtest import spawn_server, stop_server
from client_support import LoopbackApp as ServerThread
from service_support import C, MODEL, chunks, config, hash_of, store


def test_blend_client_over_a_real_socket():
    rows = chunks(4)
    rows[2][:4] = rows[0][C - 4:]  # so that chunk 2 can overlap the end of chunk 0 in a query
    with ServerThread(create_app(config())) as url, BlendClient(url) as client:
        assert client.healthz()
        assert client.post_events([store("i1", 1, rows)])["applied"] == 1
        # overlapping matches: the same content twice, C/2 apart
        q = np.concatenate([rows[1][: C // 2], rows[1], rows[1], rows[3]])
        got = client.lookup(q, MODEL)
        assert [x.cur_st for x in got] == [C // 2, C // 2 + 2 * C]  # at most one match per chunk hash
        q2 = np.concatenate([rows[0], rows[2][4:]])
        got2 = client.lookup(q2, MODEL)
        assert got2 == [BlendMatch(hash_of(0), 0, 0), BlendMatch(hash_of(2), 2 * C, C - 4)]
        assert resolve_overlaps(got2, C) == [got2[0]]
        many = client.lookup_batch([(q2, BlendNamespace(MODEL))] * 50)
        assert many == [got2] * 50
        with pytest.raises(BlendHTTPError) as ei:
            client.lookup(q, MODEL, world_size=0)
        assert ei.value.status_code == 422
        stats = client.stats()
        assert stats["blendmatch"]["engine"]["name"] == "cpu" and stats["blendmatch"]["batcher"]["queries"] >= 52


@pytest.mark.slow
def test_cli_serves_with_lmcache_style_flags(tmp_path):
    proc, url = spawn_server(["--chunk-size", str(C), "--engine", "cpu", "--enable-blend-lookup",
                              "--blend-probe-stride", "1", "--log-level", "info"], log_path=tmp_path / "server.log")
    try:
        rows = chunks(1)
        with BlendClient(url) as client:
            client.post_events([store("i1", 1, rows)])
            assert client.lookup(rows[0], MODEL) == [BlendMatch(hash_of(0), 0, 0)]
    finally:
        code = stop_server(proc)
    log = (tmp_path / "server.log").read_text()
    assert code == 0, log
    startup = [line for line in log.splitlines() if "blendmatch serving: engine" in line]
    assert len(startup) == 1 and "engine cpu (asked for by name)" in startup[0], log


def test_a_crashed_server_leaves_every_thread_stack_in_its_log(tmp_path):
    """A native crash (here a SIGSEGV sent to it) ends ``blendmatch serve`` with each
    thread's Python stack in its log (faulthandler), not with a bare exit status."""
    import signal

    proc, url = spawn_server(["--chunk-size", str(C), "--engine", "cpu"], log_path=tmp_path / "server.log")
    try:
        os.kill(proc.pid, signal.SIGSEGV)
        assert proc.wait(30) == -signal.SIGSEGV
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "server.log").read_text()
    assert "Fatal Python error: Segmentation fault" in log, log[-2000:]
    assert "Current thread" in log and "service/cli.py" in log and "events_thread.py" in log, log[-2000:]


def test_cli_help_and_bad_flags():
    out = subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--chunk-size", "--blend-probe-stride", "--enable-blend-lookup",
                 "--disable-blend-lookup", "--engine", "--max-batch-tokens", "--max-batch-wait-ms",
                 "--max-request-tokens", "--log-level"):
        assert flag in out.stdout, flag
    bad = subprocess.run([sys.executable, "-m", "blendmatch", "--max-batch-tokens", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--max-batch-tokens" in bad.stderr


def test_loadtest_phases_against_a_live_server():
    import asyncio

    from blendmatch.bench import loadtest

    workload = loadtest.Workload(chunk_size=C, chunks=300, tokens=512, matches_per_query=3, pool=8)
    with ServerThread(create_app(config())) as url:
        port = int(url.rsplit(":", 1)[1])

        async def go():
            await loadtest.fill("127.0.0.1", port, workload)
            reqs = loadtest.lookup_requests(f"127.0.0.1:{port}", workload)
            check = loadtest._make_check(workload.expected_matches())
            plain = await loadtest.run_phase("127.0.0.1", port, config="t", phase="lookup", requests=reqs,
                                             tokens=workload.tokens, clients=4, duration=0.5, max_requests=300,
                                             chunk_size=C, check=check)
            mixed = await loadtest.run_phase("127.0.0.1", port, config="t", phase="lookup+events", requests=reqs,
                                             tokens=workload.tokens, clients=4, duration=0.6, max_requests=10**6,
                                             chunk_size=C, check=check, event_rate=200, event_batch=10)
            return plain, mixed

        plain, mixed = asyncio.run(go())
    assert workload.expected_matches() == 3
    assert 0 < plain.requests <= 300  # bounded in count (or in time, whichever comes first)
    for r in (plain, mixed):
        assert r.errors == 0 and r.event_errors == 0 and r.requests > 0
        assert r.mean_batch is not None and r.mean_batch >= 1
    assert mixed.events_sent >= 50
    assert "| t | lookup |" in loadtest.table([plain, mixed])


def test_loadtest_refuses_non_loopback_servers():
    from blendmatch.bench import loadtest

    with pytest.raises(SystemExit, match="loopback"):
        loadtest.main(["--url", "http://10.0.0.1:9300", "--duration", "1"])


def test_loadtest_batch_histogram_from_cumulative_buckets():
    from blendmatch.bench import loadgen, loadtest

    before = {"1.0": 2, "2.0": 3, "4.0": 3, "+Inf": 3}
    after = {"1.0": 5, "2.0": 6, "4.0": 10, "+Inf": 11}
    assert loadtest._histogram(before, after) == {"1": 3, "3-4": 4, "5-inf": 1}  # empty ranges left out
    assert loadgen.request_parts(b"POST /x HTTP/1.1\r\nHost: h\r\n\r\n{}") == ("POST", "/x", b"{}")


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)")
def test_loadtest_wrk_generator_against_a_live_server():
    import asyncio

    from blendmatch.bench import loadtest

    workload = loadtest.Workload(chunk_size=C, chunks=300, tokens=512, matches_per_query=3, pool=8)
    with ServerThread(create_app(config())) as url:
        port = int(url.rsplit(":", 1)[1])

        async def go():
            await loadtest.fill("127.0.0.1", port, workload)
            reqs = loadtest.lookup_requests(f"127.0.0.1:{port}", workload, "ids")
            return await loadtest.run_phase("127.0.0.1", port, config="t", phase="lookup+events", requests=reqs,
                                            tokens=workload.tokens, clients=4, duration=1, max_requests=10**6,
                                            chunk_size=C, event_rate=200, event_batch=10, generator="wrk",
                                            server_pid=os.getpid())

        r = asyncio.run(go())
    assert r.generator == "wrk" and r.requests > 0 and r.errors == 0 and r.event_errors == 0
    assert r.p50_ms <= r.p99_ms <= r.p999_ms <= r.max_ms
    assert r.server_cpu_us_per_req is not None and r.server_cpu_us_per_req > 0
    assert sum(r.batch_histogram.values()) >= 1
