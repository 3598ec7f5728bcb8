"""Drive blendmatch with LMCache 0.5.6's own client code (run as a subprocess by
``tests/test_lmcache_compat.py``; never imported by the test session).

Usage: ``python lmcache_driver.py SITE capture OUT_DIR`` writes the bodies LMCache's
serializer and HTTP sink send (store, delete, access, config) into ``OUT_DIR``;
``python lmcache_driver.py SITE live URL`` drives a live blendmatch at ``URL`` with LMCache's
event subscriber + HTTP sink, its registrar (``register``, ``keep_registered``) and its
``BlendCoordinatorClient``, and prints one JSON line of what happened.

``SITE`` is where the wheel was unpacked (``pip install --no-deps``). Stand-ins are
installed first for what LMCache imports but never uses on these paths: ``torch`` (used
only in annotations, aliases and defaults at import time), ``lmcache.v1.memory_management``
and ``lmcache.v1.mp_observability.config`` (both pull in the libtorch-linked native
extension). Everything else is LMCache's code, unmodified; the only patch is the clock
``cache_events`` stamps ``ts`` with in capture mode, so the fixtures are deterministic.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
import types


# ----------------------------------------------------------------------------- stand-ins
# torch and two libtorch-linked modules, replaced: one copy, shared with the load test's
# LMCache server (bench/lmcache_serve.py)
from blendmatch.bench.lmcache_serve import install_stand_ins  # noqa: E402


# ----------------------------------------------------------------------------- LMCache events
MODEL = "Qwen/Qwen3-8B"
INSTANCE = "mp-fixture-0"
INCARNATION = 1767225000
FIXED_TS = 1767225600.25
KV_RANK = (1 << 24) | (1 << 8)  # world size 1 (LMCache's packing, as its servers send it)
CHUNK = [101, 102, 103, 104]


class RecordingSink:
    """Wraps LMCache's HttpCacheEventSink: records each publish and whether it raised."""

    def __init__(self, sink):
        self.sink = sink
        self.calls: list[str] = []

    def publish(self, batches):
        try:
            self.sink.publish(batches)
        except Exception as exc:  # noqa: BLE001 - recorded; the subscriber would only log it
            self.calls.append(f"failed: {exc}")
            raise
        self.calls.append("ok")

    def close(self):
        self.sink.close()


def emit_all(url: str, on_flush, sink_impl=None) -> RecordingSink:
    """Config, store, access, delete and a multi-batch L2 flush through LMCache's own
    ``CacheEventSubscriber`` and ``HttpCacheEventSink`` (or ``sink_impl``, e.g. its
    ``KafkaCacheEventSink``); ``on_flush(name)`` after each."""
    from lmcache.v1.distributed.api import CapacitySnapshot, L1BackendType, ModuleMemoryCapacity, ObjectKey, Tier
    from lmcache.v1.distributed.internal_api import L1ObjectMeta
    from lmcache.v1.mp_coordinator.cache_events import CacheEventSubscriber, HttpCacheEventSink
    from lmcache.v1.mp_observability.event import Event, EventType

    sink = RecordingSink(sink_impl if sink_impl is not None else HttpCacheEventSink(url))
    sub = CacheEventSubscriber(sink=sink, instance_id=INSTANCE, incarnation=INCARNATION, flush_interval=3600.0)
    cb = sub.get_subscriptions()

    def key(i: int, salt: str = "") -> "ObjectKey":
        return ObjectKey(chunk_hash=bytes([i]) * 32, model_name=MODEL, kv_rank=KV_RANK, cache_salt=salt)

    k1, k2, k3 = key(0x11), key(0x22), key(0x33)
    dram = L1ObjectMeta(size_bytes=2097152, backend=L1BackendType.DRAM)
    cb[EventType.SM_CAPACITY_CHANGED](Event(EventType.SM_CAPACITY_CHANGED, metadata={"snapshot": CapacitySnapshot(
        modules=(ModuleMemoryCapacity(Tier.L1, "dram", 8 * 1024**3), ModuleMemoryCapacity(Tier.L2, "fs", 0, shared=True)))}))
    sub.flush()
    on_flush("config")
    cb[EventType.MP_TOKENS](Event(EventType.MP_TOKENS, metadata={
        "chunk_hashes": [k1.chunk_hash], "token_chunks": [CHUNK], "token_offsets": [256], "parent_hashes": [None]}))
    cb[EventType.L1_WRITE_FINISHED](Event(EventType.L1_WRITE_FINISHED, metadata={"keys": [k1, k2], "meta": [dram, dram]}))
    sub.flush()
    on_flush("store")
    cb[EventType.L1_KEYS_ACCESSED](Event(EventType.L1_KEYS_ACCESSED, metadata={"keys": [k1]}))
    sub.flush()
    on_flush("access")
    cb[EventType.L1_KEYS_EVICTED](Event(EventType.L1_KEYS_EVICTED, metadata={"keys": [k2], "meta": [dram]}))
    sub.flush()
    on_flush("delete")
    salted = key(0x44, salt="tenant-a")
    cb[EventType.L2_KEYS_STORED](Event(EventType.L2_KEYS_STORED, metadata={
        "keys": [k1, salted], "sizes": [2097152, 1048576], "backend": "fs", "shared": True}))
    cb[EventType.L2_KEYS_STORED](Event(EventType.L2_KEYS_STORED, metadata={
        "keys": [k3], "sizes": [4096], "backend": "fs", "shared": True}))
    cb[EventType.L2_KEYS_ACCESSED](Event(EventType.L2_KEYS_ACCESSED, metadata={"keys": [k1], "backend": "fs", "shared": True}))
    cb[EventType.L2_KEYS_DELETED](Event(EventType.L2_KEYS_DELETED, metadata={"keys": [k3], "backend": "fs", "shared": True}))
    sub.flush()
    on_flush("multi_l2")
    # the same content under a second chunk hash, at another offset (for the per-position rule)
    k5 = key(0x55)
    cb[EventType.MP_TOKENS](Event(EventType.MP_TOKENS, metadata={
        "chunk_hashes": [k5.chunk_hash], "token_chunks": [CHUNK], "token_offsets": [512], "parent_hashes": [None]}))
    cb[EventType.L1_WRITE_FINISHED](Event(EventType.L1_WRITE_FINISHED, metadata={"keys": [k5], "meta": [dram]}))
    sub.flush()
    on_flush("store_second_hash")
    sink.close()
    return sink


# ----------------------------------------------------------------------------- capture mode
class _Capture:
    """A raw HTTP/1.1 server that keeps each request body and answers LMCache's reply."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.bodies: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                got = conn.recv(65536)
                if not got:
                    return
                buf += got
            head, rest = buf.split(b"\r\n\r\n", 1)
            n = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:"))
            while len(rest) < n:
                rest += conn.recv(65536)
            self.bodies.append(rest[:n])
            buf = rest[n:]
            reply = b'{"applied":0,"duplicates":0,"stale":0}'
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(reply), reply))


def capture(out_dir: str) -> None:
    from lmcache.v1.mp_coordinator import cache_events

    cache_events.time = types.SimpleNamespace(time=lambda: FIXED_TS, monotonic=time.monotonic)
    server = _Capture()
    names = []
    emit_all(server.url, names.append)
    os.makedirs(out_dir, exist_ok=True)
    for name, body in zip(names, server.bodies, strict=True):
        with open(os.path.join(out_dir, f"{name}.json"), "wb") as f:
            f.write(body)
    print(json.dumps({"written": names}))


# ----------------------------------------------------------------------------- live mode
async def registrar_flow(url: str) -> dict:
    import httpx

    from lmcache.v1.mp_coordinator.registrar import keep_registered, register

    out: dict = {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        out["generated_id"] = await register(client, url, http_port=8080, advertise_ip="10.1.1.1")
        registered = []
        task = asyncio.create_task(keep_registered(
            client, url, http_port=8081, instance_id=INSTANCE, advertise_ip="127.0.0.1", heartbeat_interval=0.05,
            on_registered=lambda: registered.append(time.monotonic())))
        await _until(lambda: len(registered) >= 1)
        await asyncio.sleep(0.2)  # a few heartbeats
        listed = (await client.get(f"{url}/instances")).json()["instances"]
        out["listed_after_register"] = sorted(i["instance_id"] for i in listed)
        # the coordinator forgets the instance: the next heartbeat gets a 404 and LMCache re-registers
        await client.delete(f"{url}/instances/{INSTANCE}")
        await _until(lambda: len(registered) >= 2)
        out["re_registrations"] = len(registered) - 1
        task.cancel()  # keep_registered deregisters in its finally
        try:
            await task
        except asyncio.CancelledError:
            pass
        listed = (await client.get(f"{url}/instances")).json()["instances"]
        out["listed_after_cancel"] = sorted(i["instance_id"] for i in listed)
    return out


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def blend_flow(url: str) -> dict:
    from lmcache.v1.mp_coordinator.api import BlendNamespace
    from lmcache.v1.mp_coordinator.blend_client import PENDING, BlendCoordinatorClient

    client = BlendCoordinatorClient.maybe_create(url, timeout=5.0, match_concurrency=2)
    queries = {
        "twice": ([9] + CHUNK + CHUNK + [7], BlendNamespace(model_name=MODEL)),
        "three_times": (CHUNK * 3, BlendNamespace(model_name=MODEL)),
        "other_salt": (CHUNK, BlendNamespace(model_name=MODEL, cache_salt="tenant-a")),
        "world_size_2": (CHUNK, BlendNamespace(model_name=MODEL, world_size=2)),
        "short": ([1, 2], BlendNamespace(model_name=MODEL)),
    }
    out = {}
    for rid, (tokens, ns) in queries.items():
        client.submit_match(rid, tokens, ns)
    deadline = time.monotonic() + 10
    for rid in queries:
        while client.poll_match(rid) is PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        got = client.poll_match(rid)
        out[rid] = [[m.chunk_hash.hex(), m.old_st, m.cur_st] for m in got]
        client.take_match(rid)
    client.close()
    return out


def live(url: str) -> None:
    sink = emit_all(url, lambda name: None)
    result = {"sink_calls": sink.calls}
    import httpx

    result["usage"] = httpx.get(f"{url}/instances/usage").json()  # a plain request, not LMCache's code
    result["blend"] = blend_flow(url)  # before the registrar flow: deregistration fences mp-fixture-0's L1
    result["registrar"] = asyncio.run(registrar_flow(url))
    print(json.dumps(result))


def kafka(target: str) -> None:
    """``BOOTSTRAP/TOPIC``: the same events through LMCache's ``KafkaCacheEventSink`` (real
    confluent-kafka producer); prints the publish outcomes and the sink's counters."""
    from lmcache.v1.mp_coordinator.cache_events import KafkaCacheEventSink
    from lmcache.v1.multiprocess.config import KafkaCacheEventSinkConfig

    bootstrap, topic = target.rsplit("/", 1)
    sink = emit_all("", lambda name: None, KafkaCacheEventSink(KafkaCacheEventSinkConfig(bootstrap, topic)))
    print(json.dumps({"sink_calls": sink.calls}))


# ----------------------------------------------------------------------------- hashes mode
def hashes(spec_path: str) -> None:
    """``SPEC`` (JSON: ``chunk_size``, ``algorithms``, ``sequences``): LMCache's own
    ``TokenHasher`` (vLLM's hash functions loaded the way it loads them, from whatever
    ``vllm`` is on the path) hashes every sequence with every algorithm; prints
    ``{algorithm: {"none_hash": hex, "chunks": [[hex, ...] per sequence]}}``."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    with open(spec_path) as f:
        spec = json.load(f)
    out = {}
    for algorithm in spec["algorithms"]:
        hasher = TokenHasher(chunk_size=spec["chunk_size"], hash_algorithm=algorithm)
        out[algorithm] = {"none_hash": TokenHasher.hash_to_bytes(hasher.none_hash).hex(),
                          "chunks": [[h.hex() for h in hasher.compute_chunk_hashes(seq)] for seq in spec["sequences"]]}
    print(json.dumps(out))


# ----------------------------------------------------------------------------- coordinator mode
def coordinator(spec_path: str) -> None:
    """``SPEC`` (JSON: ``config``, LMCache's ``MPCoordinatorConfig`` fields, and ``requests``,
    ``[method, path, json_body_or_raw_string]``): LMCache's own coordinator app (its
    ``create_app``) answers each request in order; prints ``[[status, body], ...]`` (the
    body parsed as JSON when it is JSON). Runs in 3 GiB of address space."""
    import resource

    from fastapi.testclient import TestClient

    from lmcache.v1.mp_coordinator.app import create_app

    # a token-form lookup with a huge world_size makes LMCache build its key fan-out until
    # memory runs out: bounded, it is a MemoryError (a 500) instead of the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    from lmcache.v1.mp_coordinator.config import MPCoordinatorConfig

    with open(spec_path) as f:
        spec = json.load(f)
    config = MPCoordinatorConfig(**{"health_check_interval": 0.0, "eviction_check_interval": 0.0, **spec["config"]})
    out = []
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        for method, path, body in spec["requests"]:
            if isinstance(body, str):
                resp = client.request(method, path, content=body.encode(), headers={"content-type": "application/json"})
            else:
                resp = client.request(method, path, json=body)
            try:
                parsed = resp.json()
            except ValueError:
                parsed = resp.text
            out.append([resp.status_code, parsed])
    print(json.dumps(out))


if __name__ == "__main__":
    site, mode, arg = sys.argv[1:4]
    install_stand_ins(site)
    import logging

    logging.disable(logging.INFO)  # LMCache logs every registration at INFO
    {"capture": capture, "live": live, "kafka": kafka, "hashes": hashes, "coordinator": coordinator}[mode](arg)
