"""Serving from an installed wheel writes nothing into the installed package (issue 45, item 2).

The README's two commands in one venv (``pip install . && blendmatch serve``, then
``pip install -e ".[test]"``) broke when numba wrote its cache into
``site-packages/blendmatch/*/__pycache__``: the uninstall left that folder behind, and it
shadowed the editable install. Here the wheel is built and installed (``--no-deps``) into
a fresh venv that sees this environment's dependencies, ``blendmatch serve`` answers one
STORE of a 256-token entry and one lookup that finds it, and the package folder must be
exactly as installed: no new file, no changed one.

The venv and the compile cache live in one folder per user under the temp dir, re-created
each run but at the same path: numba keys its cache by the source files' folder and
contents, so only the first run on a machine compiles cold (about a minute on a quiet
2-core VM), later ones load in seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _store_body(tokens: np.ndarray) -> bytes:
    """LMCache 0.5.6's ``POST /events`` body: one STORE of one entry, world size 1."""
    key = {"chunk_hash_hex": "ab" * 32, "model_name": "wheel-test", "kv_rank": 1 << 24, "object_group_id": 0,
           "cache_salt": ""}
    batch = {"instance_id": "mp-wheel", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1",
             "backend": "dram", "shared": False, "ts": 1767225600.0, "capacity_bytes": 0, "capacity_revision": 0,
             "entries": [{"key": key, "size_bytes": 2 << 20, "token_ids": tokens.tolist(), "token_offset": 0}]}
    return json.dumps({"batches": [batch]}).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def stable_folder():
    """This user's folder for the venv and the cache, held exclusively (one run at a time)."""
    folder = Path(tempfile.gettempdir()) / f"blendmatch-wheel-test-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def test_serving_from_an_installed_wheel_writes_nothing_into_the_package(tmp_path: Path, stable_folder: Path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "top", "bench", "gpu", "index", "service"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    wheel = next((tmp_path / "dist").glob("blendmatch-*.whl"))

    venv = stable_folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)], check=True,
                   timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # this environment's dependencies (the new venv sees the base interpreter's only)
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_blendmatch_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    run = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    package = site / "blendmatch"
    assert (package / "__init__.py").exists()
    before = _snapshot(package)

    cache = stable_folder / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env.update(BLENDMATCH_CACHE_DIR=str(cache), HOME=str(tmp_path / "home"))
    which = subprocess.run([str(python), "-c", "import blendmatch; print(blendmatch.__file__)"], env=env,
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    assert which == str(package / "__init__.py"), f"the venv imports blendmatch from {which}"

    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen([str(venv / "bin" / "blendmatch"), "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--engine", "cpu"], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            deadline = time.monotonic() + 900  # a cold compile on a loaded machine
            while True:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "not ready in time"
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            tokens = np.random.default_rng(45).integers(100_000, 150_000, size=256, dtype=np.uint32)
            stored = client.post("/events", content=_store_body(tokens), headers={"content-type": "application/json"})
            assert stored.status_code == 200 and stored.json()["applied"] == 1, stored.text
            found = client.post("/directory/blend-lookup", json={"model_name": "wheel-test",
                                                                 "token_ids": tokens.tolist()})
            assert found.status_code == 200, found.text
            assert found.json()["matches"] == [{"chunk_hash": "ab" * 32, "old_st": 0, "cur_st": 0}]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]

    after = _snapshot(package)
    added = sorted(set(after) - set(before))
    assert not added, f"serving wrote into the installed package: {added[:10]} ({len(added)} in all)"
    assert after == before, "serving changed files of the installed package"
    assert list(cache.rglob("*.nbi")), "the compile cache did not go to $BLENDMATCH_CACHE_DIR"
