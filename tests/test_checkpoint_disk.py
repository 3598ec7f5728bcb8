"""Checkpoints on failing disks and bad paths (issue 23 items 8-10), with real files and real
``blendmatch serve`` processes:

- a full filesystem (a 4 MiB tmpfs, filled up after the first checkpoint) and a vanished
  directory: failed checkpoints show in ``/readyz`` (a warning; still 200) and in metrics;
  a stop whose final checkpoint failed exits non-zero with an ERROR;
- ``--checkpoint-path`` naming a directory, or a file the server did not write: a clear
  start error, and nothing is moved;
- two servers on one path: the second refuses to start and names the first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ckpt_workload import C, workload
from service_support import config, served
from test_durability_service import ROOT, Server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _serve_and_wait_exit(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", "0",
                           "--engine", "cpu", "--chunk-size", str(C), "--log-level", "warning", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _wait(what: str, cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (skipped where mounting is not permitted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(directory) -> None:
    """Write until the filesystem is full."""
    with open(os.path.join(directory, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------- 8


def test_full_disk_shows_in_readyz_and_metrics_and_the_failed_final_checkpoint_exits_nonzero(small_disk):
    path = str(small_disk / "state.ckpt")
    server = Server(path, interval=0.2)
    try:
        server.wait_ready()
        batches = workload(2, 20, restarts=False)
        for b in batches[:10]:
            server.send(b)
        _wait("a checkpoint written", lambda: _metric(server.client, "blendmatch_checkpoint_bytes") > 0)
        assert os.path.exists(path)
        _fill(small_disk)
        for b in batches[10:]:
            server.send(b)
        _wait("checkpoints failing", lambda: _metric(server.client, "blendmatch_checkpoint_consecutive_failures") >= 2)
        r = server.client.get("/readyz")
        assert r.status_code == 200, r.text  # the answers are still right: stays in rotation
        warning = r.json()["warnings"][0]
        assert warning.startswith("checkpoint failing:") and "No space left on device" in warning
        assert _metric(server.client, "blendmatch_checkpoint_failing") == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 1
        err = server.proc.stderr.read()
        assert "ERROR" in err and "final checkpoint to" in err and "exiting non-zero" in err
    finally:
        server.close()


async def test_vanished_checkpoint_directory_in_process(tmp_path, caplog):
    """The same without a mount: the checkpoint's directory is replaced by a file."""
    d = tmp_path / "ckpts"
    d.mkdir()
    async with served(config(checkpoint_path=str(d / "state.ckpt"), checkpoint_interval=0)) as (client, app):
        ctx = app.state.blendmatch_context
        await ctx.wait_restored()
        assert (await client.post("/admin/checkpoint")).status_code == 200
        shutil.move(str(d), str(tmp_path / "moved"))
        d.write_text("not a directory")
        for _ in range(2):
            assert (await client.post("/admin/checkpoint")).status_code == 500
        r = await client.get("/readyz")
        assert r.status_code == 200
        assert r.json()["warnings"][0].startswith("checkpoint failing: 2 attempts in a row")
        assert "blendmatch_checkpoint_consecutive_failures 2.0" in (await client.get("/metrics")).text
    assert ctx.durability.final_error is not None  # the CLI exits 1 on it
    assert any(r.levelname == "ERROR" and r.getMessage().startswith("final checkpoint to") for r in caplog.records)


# ---------------------------------------------------------------------------------------------- 9


def test_checkpoint_path_naming_a_directory_is_a_start_error_and_nothing_moves(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    (d / "precious").write_text("keep me")
    done = _serve_and_wait_exit("--checkpoint-path", str(d))
    assert done.returncode == 1
    assert "is a directory; name a file in it" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["state"] and (d / "precious").read_text() == "keep me"


def test_a_file_the_server_did_not_write_is_never_moved(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("an operator's file, named by mistake")
    done = _serve_and_wait_exit("--checkpoint-path", str(path))
    assert done.returncode == 1
    assert "this server did not write it" in done.stderr
    assert path.read_text() == "an operator's file, named by mistake"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "notes.txt.lock") == ["notes.txt"]


# --------------------------------------------------------------------------------------------- 10


def test_second_server_on_one_checkpoint_path_refuses_to_start(tmp_path):
    path = str(tmp_path / "state.ckpt")
    first = Server(path, interval=0.2)
    try:
        first.wait_ready()
        done = _serve_and_wait_exit("--checkpoint-path", path)
        assert done.returncode == 1
        assert f"in use by another blendmatch server (pid {first.proc.pid} holds" in done.stderr
        assert first.client.get("/readyz").status_code == 200  # the first is untouched
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=60) == 0
    finally:
        first.close()
    # the lock went with the first server: the path is usable again
    again = Server(path, interval=0.2)
    try:
        again.wait_ready()
    finally:
        again.close()


async def test_two_apps_in_one_process_cannot_share_a_path(tmp_path):
    path = str(tmp_path / "state.ckpt")
    async with served(config(checkpoint_path=path)) as (_, app):
        await app.state.blendmatch_context.wait_restored()
        with pytest.raises(Exception, match="in use by another blendmatch server"):
            async with served(config(checkpoint_path=path)):
                pass
