"""Every kernel is compiled before the service says ready (issue 45, item 1).

- after ``warmup.compile_everything``, every numba dispatcher of the package that Python
  code calls has a compiled (or cache-loaded) signature: a kernel added later without a
  path in the warm-up fails here, not as a 20 s first request in production;
- ``blendmatch serve`` compiles after its port opened: meanwhile ``/readyz`` answers 503
  ``compiling`` and lookups and event posts 503 with ``Retry-After``, then all is served;
- ``blendmatch warmup --cache-dir DIR`` compiles into DIR and says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from service_support import b64, chunks, config, events, served, store

# Run in a fresh interpreter, so that nothing compiled by other tests hides a gap.
_ENUMERATE = """
import importlib, json, pkgutil
from numba.core.dispatcher import Dispatcher
from blendmatch.service.config import ServiceConfig
from blendmatch.service.warmup import compile_everything

compile_everything(ServiceConfig(engine="cpu"))
found = []
for room in ("blendmatch.gpu", "blendmatch.index", "blendmatch.service"):
    for info in pkgutil.walk_packages(importlib.import_module(room).__path__, room + "."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (cupy, confluent-kafka, pyzmq) not installed
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, Dispatcher) and obj.__module__ == module.__name__:
                found.append((f"{module.__name__}.{name}", obj))

def names(code):
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= names(const)
    return out

# Kernels called only from other kernels: loading the caller from the cache brings their
# code along without compiling them on their own (and inline="always" ones never are).
callees = set()
for _, d in found:
    for name in names(d.py_func.__code__):
        obj = d.py_func.__globals__.get(name)
        if isinstance(obj, Dispatcher) and obj is not d:
            callees.add(id(obj))
print(json.dumps({"dispatchers": len(found),
                  "uncompiled": sorted(q for q, d in found if not d.signatures and id(d) not in callees
                                       and d.targetoptions.get("inline") != "always")}))
"""

#: Kernels the service never runs (a library function), with why.
NOT_RUN_BY_THE_SERVICE = {
    "blendmatch.gpu.fingerprint._rolling_nb": "gpu.rolling_fingerprints, a public helper no engine or path calls",
}


@pytest.mark.slow
def test_every_kernel_the_service_calls_is_compiled_by_the_warm_up() -> None:
    proc = subprocess.run([sys.executable, "-c", _ENUMERATE], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dispatchers"] >= 30, got  # the enumeration really finds the kernels
    assert sorted(set(got["uncompiled"]) - set(NOT_RUN_BY_THE_SERVICE)) == [], (
        "kernels without a compiled signature after the warm-up: give each a path in service/warmup.py")


async def _compiling_window() -> None:
    """A served app whose compilation is held open by the test, then released."""
    from blendmatch.service import warmup

    release = threading.Event()
    real = warmup.compile_everything

    def held(*args, **kwargs):
        release.wait(60)
        return real(*args, **kwargs)

    warmup.compile_everything = held
    try:
        from blendmatch.service.app import create_app

        app = create_app(config())
        app.state.blendmatch_context.compile_mode = "background"  # what `blendmatch serve` sets
        import httpx

        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                ready = await client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["reasons"] == ["compiling"]
                assert (await client.get("/healthz")).status_code == 200  # alive meanwhile
                rows = chunks(2)
                posted = await client.post("/events", json=events(store("mp-0", 1, rows)))
                assert posted.status_code == 503 and posted.headers["retry-after"] == "1", posted.text
                assert "compiling" in posted.json()["detail"]
                query = {"model_name": "llama", "tokens_b64": b64(rows.reshape(-1))}
                for path, body in (("/directory/blend-lookup", query),
                                   ("/directory/blend-lookup", {**query, "tokens_b64": None,
                                                                 "token_ids": rows.reshape(-1).tolist()}),
                                   ("/directory/blend-lookup/batch", {"queries": [query]})):
                    got = await client.post(path, json=body)
                    assert got.status_code == 503 and got.headers["retry-after"] == "1", (path, got.text)
                release.set()
                for _ in range(600):
                    if (await client.get("/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                assert (await client.get("/readyz")).json() == {"status": "ready"}
                posted = await client.post("/events", json=events(store("mp-0", 1, rows)))
                assert posted.status_code == 200 and posted.json()["applied"] == 1
                got = await client.post("/directory/blend-lookup", json=query)
                assert got.status_code == 200 and len(got.json()["matches"]) == 2
    finally:
        release.set()
        warmup.compile_everything = real


def test_while_compiling_readyz_and_requests_answer_503_compiling_then_serve() -> None:
    asyncio.run(_compiling_window())


def test_an_in_process_app_is_compiled_when_its_lifespan_has_started() -> None:
    async def run() -> None:
        async with served() as (client, app):
            assert app.state.blendmatch_context.compile_mode == "wait"
            assert (await client.get("/readyz")).json() == {"status": "ready"}
            from blendmatch.service import warmup

            assert warmup._done, "the lifespan did not run the warm-up"

    asyncio.run(run())


@pytest.mark.slow
def test_the_warmup_command_compiles_into_its_cache_dir(tmp_path: Path) -> None:
    """``blendmatch warmup --cache-dir DIR``: into DIR. DIR starts as a copy of this
    process's (warm) cache less one module's files, so the test takes seconds and still
    shows that the command compiled into DIR."""
    from blendmatch.compile_cache import current
    from blendmatch.service.config import ServiceConfig
    from blendmatch.service.warmup import compile_everything

    compile_everything(ServiceConfig(engine="cpu"))  # this process's cache is warm now
    target = tmp_path / "cache"
    shutil.copytree(current().folder, target / "numba")
    removed = [p for p in (target / "numba").rglob("*") if p.name.startswith("occupancy.")]
    assert removed, "the warm cache holds no gpu/occupancy.py kernel"
    for p in removed:
        p.unlink()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "BLENDMATCH_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-m", "blendmatch", "warmup", "--cache-dir", str(target)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(target / "numba") in proc.stdout and "compiled in" in proc.stdout, proc.stdout
    assert [p for p in (target / "numba").rglob("*") if p.name.startswith("occupancy.")], (
        "the occupancy kernel was not compiled into --cache-dir")


def test_the_scratch_service_keeps_nothing_of_the_real_ones_outside_reach_or_limits() -> None:
    """The warm-up's own requests must pass whatever the real limits are, and its scratch
    service must reach nothing outside the process (no checkpoint, broker, socket, upstream)."""
    from blendmatch.service.config import ServiceConfig
    from blendmatch.service.warmup import _scratch_config

    real = ServiceConfig(event_transport="kafka", kafka_bootstrap_servers="broker:9092", replica_id="r1",
                         kv_events_endpoint="tcp://127.0.0.1:5557", checkpoint_path="/tmp/never.ckpt",
                         require_checkpoint=True, upstream_coordinator="http://upstream:9000",
                         max_request_tokens=100, max_body_bytes=2048, max_bytes_in_flight=1 << 16,
                         enable_blend_lookup=False, chunk_size=64, blend_probe_stride=4)
    scratch = _scratch_config(real)
    assert (scratch.event_transport, scratch.kv_events_endpoint, scratch.checkpoint_path,
            scratch.upstream_coordinator) == ("http", "", "", "")
    defaults = ServiceConfig()
    assert scratch.max_request_tokens == defaults.max_request_tokens
    assert scratch.max_body_bytes == defaults.max_body_bytes and scratch.enable_blend_lookup
    assert (scratch.chunk_size, scratch.blend_probe_stride) == (64, 4)  # the real index's shape
