"""Compatibility with the real LMCache 0.5.6: its own producer, registrar and blend client
against a live blendmatch (real socket, real uvicorn server), with no rejected request.

The wheel is installed with ``--no-deps`` into a test-only directory
(``$BLENDMATCH_LMCACHE_DIR``, else ``.pytest_cache/lmcache-0.5.6`` under the repository);
LMCache's side runs in a subprocess (``tests/lmcache_driver.py``) with stand-ins for the
heavy modules it imports but does not use on these paths (torch, its native extension),
so nothing of it leaks into this test session. Skips, with the reason, only when the wheel
cannot be fetched. Marked ``compat``; CI runs it (it has PyPI access).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from blendmatch.service.app import create_app
from blendmatch.service.config import ServiceConfig
from service_support import metric_samples

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "lmcache"
DRIVER = Path(__file__).parent / "lmcache_driver.py"
VERSION = "0.5.6"
#: LMCache's pure-Python dependencies that these paths import (also in the ``test`` extra).
RUNTIME_DEPS = ("msgspec", "cachetools")


@pytest.fixture(scope="session")
def lmcache_site() -> Path:
    """The unpacked lmcache==0.5.6 wheel (fetched once, then reused)."""
    target = Path(os.environ.get("BLENDMATCH_LMCACHE_DIR") or ROOT / ".pytest_cache" / f"lmcache-{VERSION}")
    marker = target / "lmcache" / "v1" / "mp_coordinator" / "cache_events.py"
    if not marker.exists():
        download = target.parent / f"lmcache-{VERSION}-wheel"
        download.mkdir(parents=True, exist_ok=True)
        # pure-Python modules only are used, so any CPython wheel of the release will do: ask
        # for the cp311 manylinux one explicitly, whatever Python runs the tests
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.11", "--platform", "manylinux_2_28_x86_64", "--dest", str(download), f"lmcache=={VERSION}"]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        wheels = sorted(download.glob(f"lmcache-{VERSION}-*.whl"))
        if got.returncode != 0 or not wheels:
            pytest.skip(f"lmcache=={VERSION} wheel could not be fetched: {(got.stderr or got.stdout)[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(target)
    missing = [m for m in RUNTIME_DEPS if _missing(m)]
    if missing:
        pytest.fail(f"install the test extra (pip install 'blendmatch[test]'): missing {missing}")
    return target


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def _drive(site: Path, mode: str, arg: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    got = subprocess.run([sys.executable, str(DRIVER), str(site), mode, arg], capture_output=True, text=True,
                         timeout=120, env=env, cwd=str(ROOT))
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


class LiveServer:
    """blendmatch under uvicorn on a real socket, in a thread."""

    def __init__(self, config: ServiceConfig) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_keep_alive=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def test_fixtures_are_lmcache_serializer_output_byte_for_byte(lmcache_site, tmp_path):
    """tests/fixtures/lmcache/*.json are exactly what LMCache's serializer and HTTP sink send."""
    written = _drive(lmcache_site, "capture", str(tmp_path))["written"]
    assert written == ["config", "store", "access", "delete", "multi_l2", "store_second_hash"]
    for name in ("config", "store", "access", "delete", "multi_l2"):
        assert (tmp_path / f"{name}.json").read_bytes() == (FIXTURES / f"{name}.json").read_bytes(), name


def test_lmcache_producer_registrar_and_blend_client_against_live_blendmatch(lmcache_site):
    cfg = ServiceConfig(host="127.0.0.1", chunk_size=4, engine="cpu", health_check_interval=0)
    with LiveServer(cfg) as live:
        result = _drive(lmcache_site, "live", live.url)
        stats = httpx.get(f"{live.url}/directory/stats").json()
        samples = metric_samples(httpx.get(f"{live.url}/metrics").text)
    # every event request LMCache's sink sent was accepted (it raises on any non-2xx)
    assert result["sink_calls"] == ["ok"] * 6
    events = stats["blendmatch"]["events"]
    assert events["applied"] == 2 + 1 + 1 + 1 + 3 + 1  # batches: config x2, store, access, delete, L2 x3, store
    assert events["duplicates"] == events["stale"] == 0
    assert not any(k.startswith("blendmatch_http_rejected_total") and v for k, v in samples.items())
    # LMCache's capacity declaration (config batches) joined to used bytes, before deregistration
    usage = result["usage"]
    assert [i["instance_id"] for i in usage["instances"]] == ["mp-fixture-0"]
    assert usage["instances"][0]["modules"] == [{"tier": "l1", "backend": "dram", "shared": False,
                                                 "used_bytes": 2 * 2097152, "capacity_bytes": 8 * 1024**3,
                                                 "usage_ratio": 2 * 2097152 / (8 * 1024**3)}]
    assert usage["shared_modules"] == [{"tier": "l2", "backend": "fs", "shared": True, "used_bytes": 2097152 + 1048576,
                                        "capacity_bytes": 0, "usage_ratio": None}]
    assert stats["blendmatch"]["capacity"] == []  # forgotten with the deregistration, as in LMCache
    # registrar: a generated id, heartbeats, re-registration after a 404, deregistration on cancel
    reg = result["registrar"]
    assert reg["generated_id"].startswith("mp-")
    assert reg["listed_after_register"] == sorted([reg["generated_id"], "mp-fixture-0"])
    assert reg["re_registrations"] >= 1
    assert reg["listed_after_cancel"] == [reg["generated_id"]]
    # blend client: LMCache's per-position rule; k1 (offset 256) first-indexed, k5 (512) second
    k1, k5 = "11" * 32, "55" * 32
    blend = result["blend"]
    assert blend["twice"] == [[k1, 256, 1], [k5, 512, 5]]
    assert blend["three_times"] == [[k1, 256, 0], [k5, 512, 4]]
    assert blend["other_salt"] == [] and blend["world_size_2"] == [] and blend["short"] == []
