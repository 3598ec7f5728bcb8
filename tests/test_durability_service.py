"""Durability of the running service: SIGKILL at random points and restart from the
checkpoint (answers equal a server that applied exactly the checkpointed events; a re-send
is a duplicate up to the checkpoint and applied after it, never twice), graceful stop loses
nothing, a second signal exits at once, corrupt files never crash, /readyz, the admin
checkpoint, ``checkpoint inspect``. Real processes and sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest

from blendmatch.index.checkpoint import restore_directory
from blendmatch.index.ckpt_file import read_checkpoint
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.service.cli import main as cli_main

from ckpt_workload import C, answers, feed, queries, workload
from service_support import config, served

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, ckpt: str, *extra: str, interval: float = 0.2) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--engine", "cpu", "--chunk-size", str(C), "--checkpoint-path", ckpt,
             "--checkpoint-interval", str(interval), "--log-level", "warning", *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("server not ready in time")

    def send(self, batch: dict[str, Any]) -> dict[str, int]:
        """The reply's batch counts (LMCache's three; our per-entry extras are left out)."""
        r = self.client.post("/events", json={"batches": [batch]})
        assert r.status_code == 200, r.text
        return {k: r.json()[k] for k in ("applied", "duplicates", "stale")}

    def matches(self, qs) -> list[list[tuple[str, int, int]]]:
        out = []
        for tokens, ns in qs:
            r = self.client.post("/directory/blend-lookup", json={
                "token_ids": tokens.tolist(), "model_name": ns.model_name, "cache_salt": ns.cache_salt,
                "world_size": ns.world_size})
            assert r.status_code == 200, r.text
            out.append([(m["chunk_hash"], m["old_st"], m["cur_st"]) for m in r.json()["matches"]])
        return out

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _fresh() -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, engine="cpu")
    return d


def _reference(batches, k: int) -> KeyDirectory:
    d = _fresh()
    feed(d, batches[:k])
    return d


def _prefix_in_checkpoint(path: str, batches) -> int:
    """How many of ``batches`` (all admitted, sent in order, one per request) the checkpoint
    holds: the prefix whose gate cursors it saved."""
    if not os.path.exists(path):
        return 0
    with read_checkpoint(path) as ck:
        cursors = {i: c["last_seq"] for i, c in ck.section("gate").doc["cursors"].items()}
    seen: dict[str, int] = {}
    for k in range(len(batches) + 1):
        if seen == cursors:
            return k
        if k < len(batches):
            seen[batches[k]["instance_id"]] = batches[k]["seq"]
    raise AssertionError(f"checkpoint cursors {cursors} are no prefix of the workload")


def _http_answers(d: KeyDirectory, qs) -> list[list[tuple[str, int, int]]]:
    return [[(m.chunk_hash.hex(), m.old_st, m.cur_st) for m in ms] for ms in d.blend_index.match_batch(qs)]


def test_sigkill_at_random_points_then_restore_and_resend(tmp_path):
    seed = 21
    batches = workload(seed, 150, restarts=False)
    qs = queries(seed, 15)
    ckpt = str(tmp_path / "state.ckpt")
    rng = np.random.default_rng(seed)
    sent = 0
    restored_prefixes = []
    for rnd in range(3):
        server = Server(ckpt)
        try:
            server.wait_ready()
            k = _prefix_in_checkpoint(ckpt, batches)
            assert k <= sent
            restored_prefixes.append(k)
            ref = _reference(batches, k)
            # the server answers exactly as one that applied the first k batches
            assert server.matches(qs) == _http_answers(ref, qs)
            with read_checkpoint(ckpt) if k else _null() as ck:
                if ck is not None:
                    mine = _fresh()
                    restore_directory(mine, ck)
                    assert _no_dup_count(answers(mine, seed)) == _no_dup_count(answers(ref, seed))
            # re-send everything from a little before the checkpoint: duplicates up to it, then applied
            start = max(0, k - 10)
            for i in range(start, sent):
                counts = server.send(batches[i])
                assert counts == ({"applied": 0, "duplicates": 1, "stale": 0} if i < k
                                  else {"applied": 1, "duplicates": 0, "stale": 0}), (i, k)
            assert server.matches(qs) == _http_answers(_reference(batches, sent), qs)
            if rnd == 2:
                break
            kill_at = min(len(batches), sent + int(rng.integers(20, 50)))
            for i in range(sent, kill_at):
                assert server.send(batches[i])["applied"] == 1
                time.sleep(float(rng.random()) * 0.01)  # periodic checkpoints land at random points
            sent = kill_at
            # on a loaded machine the round's sends can all finish before a periodic
            # checkpoint lands (seen once in CI: restored prefixes [0, 0, 43]); the kill then
            # waits for one holding some of this round, so that every restore after it has
            # a prefix to check. A quiet machine has one already: it kills at once.
            deadline = time.monotonic() + 60
            while _prefix_in_checkpoint(ckpt, batches) <= k and time.monotonic() < deadline:
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
        finally:
            server.close()
    assert restored_prefixes[0] == 0 and all(k > 0 for k in restored_prefixes[1:]), restored_prefixes


def _no_dup_count(a: dict[str, Any]) -> dict[str, Any]:
    """Answers without the gate's duplicate counter (earlier rounds' re-sends count there)."""
    a["stats"]["events"].pop("duplicates")
    return a


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_graceful_stop_loses_nothing_and_second_signal_exits_at_once(tmp_path):
    seed = 5
    batches = workload(seed, 60, restarts=False)
    qs = queries(seed, 10)
    ckpt = str(tmp_path / "state.ckpt")
    server = Server(ckpt, interval=0)  # 0: checkpoints only on a clean stop
    try:
        server.wait_ready()
        for b in batches:
            server.send(b)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.close()
    assert _prefix_in_checkpoint(ckpt, batches) == len(batches)
    server = Server(ckpt, interval=0)
    try:
        server.wait_ready()
        assert server.matches(qs) == _http_answers(_reference(batches, len(batches)), qs)
        assert server.send(batches[-1]) == {"applied": 0, "duplicates": 1, "stale": 0}
        before = open(ckpt, "rb").read()
        server.send(batches[0] | {"seq": 10_000})  # a change the killed stop must not save
        # a request whose body never completes holds the graceful stop in its drain phase
        hold = socket.create_connection(("127.0.0.1", server.port))
        hold.sendall(b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None  # still draining
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 5  # at once, not after the drain timeout
        hold.close()
    finally:
        server.close()
    assert open(ckpt, "rb").read() == before  # the previous checkpoint stands
    with read_checkpoint(ckpt) as ck:
        ck.verify()


def test_require_checkpoint_exits_nonzero(tmp_path):
    server = Server(str(tmp_path / "missing.ckpt"), "--require-checkpoint")
    try:
        assert server.proc.wait(timeout=60) == 1
        assert "require-checkpoint" in server.proc.stderr.read()
    finally:
        server.close()


# ---------------------------------------------------------------------- in-process
async def test_corrupt_checkpoint_is_set_aside_and_server_starts_cold(tmp_path):
    path = tmp_path / "state.ckpt"
    path.write_bytes(b"BMCKPT\0\0" + b"\x01\0\0\0" + b"\0" * 100)  # right magic, no trailer
    async with served(config(checkpoint_path=str(path), checkpoint_interval=0)) as (client, app):
        ctx = app.state.blendmatch_context
        await ctx.wait_restored()
        r = await client.get("/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        assert not path.exists()
        aside = [n for n in os.listdir(tmp_path) if n.startswith("state.ckpt.corrupt-")]
        assert len(aside) == 1
        metrics = (await client.get("/metrics")).text
        assert 'blendmatch_checkpoint_restore_failures_total{reason="corrupt"} 1.0' in metrics
        assert (await client.get("/directory/stats")).json()["num_keys"] == 0
    assert path.exists()  # the clean stop wrote a fresh one


async def test_unknown_version_with_require_is_fatal_in_process(tmp_path):
    path = tmp_path / "state.ckpt"
    path.write_bytes(b"BMCKPT\0\0" + (7).to_bytes(4, "little") + b"\0" * 100)
    async with served(config(checkpoint_path=str(path), require_checkpoint=True)) as (client, app):
        ctx = app.state.blendmatch_context
        with pytest.raises(Exception, match="require-checkpoint"):
            await ctx.wait_restored()
        r = await client.get("/readyz")
        assert r.status_code == 503 and "fatal" in r.json()["reasons"][0]
        heard: list[BaseException] = []
        ctx.add_fatal_listener(heard.append)  # added after the fact: told at once
        assert len(heard) == 1 and heard[0] is ctx.fatal
    left = [p.name for p in tmp_path.iterdir() if p.name != "state.ckpt.lock"]  # the lock file stays
    assert len(left) == 1 and left[0].startswith("state.ckpt.corrupt-")


async def test_readyz_waits_for_restore_and_log_lag(tmp_path):
    async with served(config(checkpoint_path=str(tmp_path / "c"), max_ready_lag=10)) as (client, app):
        ctx = app.state.blendmatch_context
        await ctx.wait_restored()
        ctx.durability.restored = False
        r = await client.get("/readyz")
        assert r.status_code == 503 and r.json()["reasons"] == ["restoring checkpoint"]
        assert (await client.get("/healthz")).status_code == 200  # liveness is not readiness
        ctx.durability.restored = True
        lag = {"n": 50}
        ctx.durability.lag = lambda: lag["n"]
        r = await client.get("/readyz")
        assert r.status_code == 503 and "lag 50 > --max-ready-lag 10" in r.json()["reasons"][0]
        lag["n"] = 10
        assert (await client.get("/readyz")).status_code == 200


async def test_admin_checkpoint_and_inspect(tmp_path, capsys):
    path = tmp_path / "state.ckpt"
    batches = workload(3, 40, restarts=False)
    async with served(config(chunk_size=C, checkpoint_path=str(path), checkpoint_interval=0)) as (client, app):
        await app.state.blendmatch_context.wait_restored()
        assert (await client.post("/events", json={"batches": batches})).json()["applied"] == 40
        r = await client.post("/admin/checkpoint")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["bytes"] == path.stat().st_size and body["ingest_pause_s"] < 5
        assert body["info"]["instances"] == 3
        metrics = (await client.get("/metrics")).text
        assert "blendmatch_checkpoint_bytes " in metrics and "blendmatch_checkpoint_ingest_pause_seconds" in metrics
    assert cli_main(["checkpoint", "inspect", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checksums"] == "ok" and report["info"]["instances"] == 3
    path.write_bytes(path.read_bytes()[:-5])
    assert cli_main(["checkpoint", "inspect", str(path)]) == 1
    async with served(config()) as (client, _):
        r = await client.post("/admin/checkpoint")
        assert r.status_code == 409 and "off" in r.json()["detail"]
