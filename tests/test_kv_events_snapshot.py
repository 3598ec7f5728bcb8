"""Snapshots on the replay socket (docs/kv-events.md#snapshots): a router that joins after the
replay ring dropped the start bootstraps from the holder set at one seq, then follows the
live stream with no gap (the reference follower, ``service/publish/follower.py``), holding
exactly the directory's holder set; every payload decoded by vLLM's own classes (strict).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from blendmatch.index import KeyDirectory
from blendmatch.service.publish import END_SEQ, KVEventsPublisher, KVEventsSettings
from blendmatch.service.publish.follower import SNAPSHOT_SEQ, KVEventsFollower, SnapshotRefused
from kv_events_support import WAIT_MS, Workload, expected_holders
from vllm_events_support import decode_batch

CHUNK = 16


class Index:
    """A router's index fed by vLLM's own decoder: (topic, medium, hash) -> tokens."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self.holders: dict[tuple[str, str, Any], tuple[int, ...]] = {}
        self.resets = 0
        self.messages = 0

    def reset(self) -> None:
        self.holders.clear()
        self.resets += 1

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.messages += 1
        t = topic.decode()
        for ev in decode_batch(self.encoding, payload).events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                bs = ev.block_size
                assert ev.parent_block_hash is None and len(ev.token_ids) == bs * len(ev.block_hashes)
                for k, h in enumerate(ev.block_hashes):
                    key = (t, ev.medium, h)
                    assert key not in self.holders, f"stored twice: {key}"
                    self.holders[key] = tuple(ev.token_ids[k * bs:(k + 1) * bs])
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    del self.holders[(t, ev.medium, h)]  # KeyError: removed what was never stored
            else:
                for key in [k for k in self.holders if k[0] == t]:
                    del self.holders[key]


def _publisher(encoding="map", int_hashes=False, endpoint="tcp://127.0.0.1:*", **kw) -> KVEventsPublisher:
    pub = KVEventsPublisher(KVEventsSettings(endpoint=endpoint, replay_endpoint="tcp://127.0.0.1:*",
                                             encoding=encoding, int_hashes=int_hashes, **kw))
    pub.start()
    return pub


def _directory(pub: KVEventsPublisher) -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=CHUNK, engine="reference")
    pub.attach_directory(d)
    return d


def _raw_snapshot(ctx: zmq.Context, endpoint: str) -> tuple[list[list[bytes]], bytes]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        req.send_multipart([b"", SNAPSHOT_SEQ.to_bytes(8, "big")])
        pages = []
        while True:
            assert req.poll(WAIT_MS), "no snapshot answer"
            frames = req.recv_multipart()
            if frames[2] == END_SEQ:
                return pages, frames[3]
            pages.append(frames[1:])
    finally:
        req.close(0)


@pytest.mark.parametrize("encoding,int_hashes", [("map", False), ("array", True)])
def test_a_late_router_bootstraps_past_the_ring_and_follows_with_no_gap(encoding, int_hashes):
    """The ring holds 5 messages of hundreds: replay from 0 cannot rebuild the state; the
    snapshot does, then live messages (and replays of the gaps) keep it exact."""
    pub = _publisher(encoding, int_hashes, buffer_steps=5, snapshot_page_blocks=7)
    d = _directory(pub)
    work = Workload(seed=50, chunk_size=CHUNK)
    ctx = zmq.Context()
    try:
        work.run(d, 300)
        assert pub.wait_idle(WAIT_MS / 1000)
        assert pub.stats()["buffer_evicted"] > 0
        index = Index(encoding)
        f = KVEventsFollower(pub.bound_endpoint, pub.bound_replay_endpoint, ctx=ctx)
        n = f.bootstrap(index.apply, index.reset)
        assert n == pub.next_seq and index.messages > 1  # paged
        assert index.holders == expected_holders(d, int_hashes)
        for phase in range(3):
            work.run(d, 80)
            assert pub.wait_idle(WAIT_MS / 1000)
            f.catch_up(index.apply, pub.next_seq, index.reset)
            assert index.holders == expected_holders(d, int_hashes), f"phase {phase}"
        assert f.bootstraps == 1 and index.resets == 1
        f.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_a_bootstrap_while_stores_and_deletes_go_on_ends_exact():
    """Ingest runs on another thread during the bootstrap (small pages, a small budget, so
    the snapshot takes many passes): the follower ends with exactly the holder set."""
    pub = _publisher(buffer_steps=4000, snapshot_page_blocks=3, replay_client_bytes=8192)
    d = _directory(pub)
    work = Workload(seed=51, chunk_size=CHUNK, n_hashes=200)
    ctx = zmq.Context()
    try:
        work.run(d, 400)
        assert pub.wait_idle(WAIT_MS / 1000)
        stop = threading.Event()

        def ingest():
            w = Workload(seed=52, chunk_size=CHUNK, n_hashes=200)
            while not stop.is_set():
                w.run(d, 5)

        t = threading.Thread(target=ingest)
        t.start()
        index = Index("map")
        f = KVEventsFollower(pub.bound_endpoint, pub.bound_replay_endpoint, ctx=ctx)
        try:
            n = f.bootstrap(index.apply, index.reset)
            time.sleep(0.3)
        finally:
            stop.set()
            t.join()
        assert pub.wait_idle(WAIT_MS / 1000)
        assert pub.next_seq > n  # ingest went on past the snapshot's seq
        f.catch_up(index.apply, pub.next_seq, index.reset)
        assert index.holders == expected_holders(d)
        assert pub.counters["dropped"] == 0
        f.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_two_publishers_fed_the_same_stream_send_the_same_snapshot_bytes():
    """Replicas at the same seq: byte-identical pages and end frame, whatever order their
    dicts were filled in (the second directory was checkpointed-through-a-fork: it sorted)."""
    a, b = _publisher("array", True, snapshot_page_blocks=5), _publisher("array", True, snapshot_page_blocks=5)
    da, db = _directory(a), _directory(b)
    ctx = zmq.Context()
    try:
        Workload(seed=53, chunk_size=CHUNK).run(da, 250)
        Workload(seed=53, chunk_size=CHUNK).run(db, 250)
        assert a.wait_idle(WAIT_MS / 1000) and b.wait_idle(WAIT_MS / 1000)
        pages_a, end_a = _raw_snapshot(ctx, a.bound_replay_endpoint)
        pages_b, end_b = _raw_snapshot(ctx, b.bound_replay_endpoint)
        assert len(pages_a) > 3 and end_a == a.next_seq.to_bytes(8, "big")
        assert pages_a == pages_b and end_a == end_b
        topics = [p[0] for p in pages_a]
        assert topics == sorted(topics)  # canonical order
    finally:
        a.stop()
        b.stop()
        ctx.destroy(linger=0)


def _big_directory(pub: KVEventsPublisher, chunks: int) -> KeyDirectory:
    """``chunks`` chunks of 256 tokens (about 800 bytes each on the wire) on one L1."""
    from blendmatch.bench.events import make_requests

    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=256, engine="reference")
    pub.attach_directory(d)
    for req in make_requests(chunks, 1000, 256, packed=True):
        d.apply(req)
    return d


def test_the_snapshot_order_is_canonical_not_the_directorys():
    """Two directories that hold the same set at the same seq, reached in another order
    (their bindings sit in another dict order): the same snapshot bytes."""
    rng = __import__("random").Random(56)

    def batch(inst, hashes, tier="l1", shared=False, backend="cpu"):
        return {"instance_id": inst, "incarnation": 0, "seq": 1, "event_type": "store", "tier": tier,
                "backend": backend, "shared": shared, "ts": 1_700_000_000.0, "entries": [
                    {"key": {"chunk_hash_hex": h.hex(), "model_name": "llama", "kv_rank": 1 << 24},
                     "token_ids": [rng.randrange(60_000) for _ in range(CHUNK)], "token_offset": 0,
                     "size_bytes": 1000} for h in hashes]}

    hs = [bytes([k]) * 16 for k in range(40)]
    x = batch("gpu-a", hs[:25])
    y = batch("gpu-b", hs[15:][::-1])
    y["entries"][-10:] = [dict(e, token_ids=next(f["token_ids"] for f in x["entries"]
                                                 if f["key"]["chunk_hash_hex"] == e["key"]["chunk_hash_hex"]))
                          for e in y["entries"][-10:]]  # the shared chunks keep their content
    a, b = _publisher(snapshot_page_blocks=6), _publisher(snapshot_page_blocks=6)
    da, db = _directory(a), _directory(b)
    ctx = zmq.Context()
    try:
        da.apply({"batches": [x]})
        da.apply({"batches": [y]})
        db.apply({"batches": [y]})
        db.apply({"batches": [x]})
        assert a.wait_idle(WAIT_MS / 1000) and b.wait_idle(WAIT_MS / 1000)
        assert a.next_seq == b.next_seq and expected_holders(da) == expected_holders(db)
        assert [kp.key.chunk_hash for kp in da.list_keys(limit=None)] != \
            [kp.key.chunk_hash for kp in db.list_keys(limit=None)]  # another order inside
        pages_a, end_a = _raw_snapshot(ctx, a.bound_replay_endpoint)
        pages_b, end_b = _raw_snapshot(ctx, b.bound_replay_endpoint)
        assert len(pages_a) > 3 and pages_a == pages_b and end_a == end_b
    finally:
        a.stop()
        b.stop()
        ctx.destroy(linger=0)


def test_snapshots_are_bounded_refused_past_the_bound_and_returned_when_clients_leave():
    """A client that never reads (a one-message receive queue, a 4 KB kernel buffer) holds
    at most its budget (+ one page) of a ~6 MB snapshot; one more snapshot than allowed is
    refused with the end marker and an empty payload; a client that leaves frees its slot
    and its bytes, and the next bootstrap gets the whole state."""
    page = 64 * 1024
    pub = _publisher(snapshot_page_bytes=page, replay_client_bytes=256 * 1024, max_snapshots=1)
    ctx = zmq.Context()
    try:
        d = _big_directory(pub, 8000)
        assert pub.wait_idle(WAIT_MS / 1000)
        lazy = ctx.socket(zmq.DEALER)
        lazy.setsockopt(zmq.LINGER, 0)
        lazy.setsockopt(zmq.RCVHWM, 1)
        lazy.setsockopt(zmq.RCVBUF, 4096)
        lazy.connect(pub.bound_replay_endpoint)
        lazy.send_multipart([b"", SNAPSHOT_SEQ.to_bytes(8, "big")])
        assert _until(lambda: pub.held_bytes()["snapshot_clients"] > 0)
        time.sleep(1.0)  # let the publisher send what the budget allows
        held = pub.held_bytes()["snapshot_clients"]
        assert 0 < held <= 256 * 1024 + page + 4096, held  # the budget, plus the page that may overrun it
        assert pub._replays.snapshots.active == 1
        pages, end = _raw_snapshot(ctx, pub.bound_replay_endpoint)
        assert pages == [] and end == b""  # refused
        assert pub.counters["snapshot_refused"] == 1
        with pytest.raises(SnapshotRefused):
            KVEventsFollower(pub.bound_endpoint, pub.bound_replay_endpoint, ctx=ctx).bootstrap(lambda *a: None)
        lazy.close(0)
        # it left: the next send fails (EHOSTUNREACH): its slot and bytes come back
        assert _until(lambda: pub._replays.snapshots.active == 0 and pub.held_bytes()["snapshot_clients"] == 0), \
            pub.stats()
        index = Index("map")
        f = KVEventsFollower(pub.bound_endpoint, pub.bound_replay_endpoint, ctx=ctx)
        f.bootstrap(index.apply, index.reset)
        assert len(index.holders) == 8000 and index.holders == expected_holders(d)
        f.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def _until(check, timeout: float = WAIT_MS / 1000) -> bool:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_the_follower_reconnects_after_a_restart_and_rebootstraps_when_the_ring_lost_its_gap(tmp_path):
    """The publisher restarts on the same endpoints with its seq (a checkpoint's section);
    what it publishes before the follower's sockets reconnect is more than its 3-message
    ring: the follower sees the gap, the replay cannot fill it, it bootstraps again (on_reset
    first) and ends with exactly the holder set. (The PUB endpoint is ipc: a tcp endpoint
    without a wildcard connects, vLLM's rule, so it could not be bound again as it was.)"""
    pub = _publisher(buffer_steps=3, endpoint=f"ipc://{tmp_path}/pub")
    d = _directory(pub)
    work = Workload(seed=55, chunk_size=CHUNK)
    ctx = zmq.Context()
    try:
        work.run(d, 100)
        assert pub.wait_idle(WAIT_MS / 1000)
        index = Index("map")
        f = KVEventsFollower(pub.bound_endpoint, pub.bound_replay_endpoint, ctx=ctx, timeout_s=10)
        f.bootstrap(index.apply, index.reset)
        work.run(d, 20)
        assert pub.wait_idle(WAIT_MS / 1000)
        f.catch_up(index.apply, pub.next_seq, index.reset)
        assert f.bootstraps == 1
        section = pub.snapshot()
        endpoints = (pub.bound_endpoint, pub.bound_replay_endpoint)
        pub.stop()
        pub = KVEventsPublisher(KVEventsSettings(endpoint=endpoints[0], replay_endpoint=endpoints[1],
                                                 buffer_steps=3))
        pub.restore(section)
        pub.start()
        pub.attach_directory(d)
        work.run(d, 100)  # published before the follower is back
        assert pub.wait_idle(WAIT_MS / 1000)
        assert pub.next_seq > section["next_seq"] + 3
        f.catch_up(index.apply, pub.next_seq, index.reset)
        assert f.bootstraps == 2 and index.resets == 2
        assert index.holders == expected_holders(d)
        work.run(d, 30)  # and it follows live again
        assert pub.wait_idle(WAIT_MS / 1000)
        f.catch_up(index.apply, pub.next_seq, index.reset)
        assert index.holders == expected_holders(d)
        f.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_the_follower_rebootstraps_when_the_publisher_restarts_empty(tmp_path):
    """A publisher restarted without its checkpoint starts again at seq 0 (a new directory):
    the follower sees only seqs below what it wants for ``stale_s``, then bootstraps again
    and holds the new directory's holder set. The first publisher has run a while (seq from
    100,000: a checkpoint's section), so the new stream stays below its position."""
    pub = KVEventsPublisher(KVEventsSettings(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint="tcp://127.0.0.1:*"))
    pub.restore({"version": 1, "next_seq": 100_000, "last_ts": 0.0, "counts": {}})
    pub.start()
    d = _directory(pub)
    ctx = zmq.Context()
    try:
        Workload(seed=57, chunk_size=CHUNK).run(d, 150)
        assert pub.wait_idle(WAIT_MS / 1000)
        index = Index("map")
        f = KVEventsFollower(pub.bound_endpoint, pub.bound_replay_endpoint, ctx=ctx, stale_s=0.3)
        f.bootstrap(index.apply, index.reset)
        endpoints = (pub.bound_endpoint, pub.bound_replay_endpoint)
        pub.stop()
        pub = KVEventsPublisher(KVEventsSettings(endpoint=endpoints[0], replay_endpoint=endpoints[1]))
        pub.start()
        d2 = _directory(pub)
        work = Workload(seed=58, chunk_size=CHUNK)
        deadline = time.monotonic() + WAIT_MS / 1000
        while f.bootstraps < 2 and time.monotonic() < deadline:
            work.run(d2, 3)
            f.poll(index.apply, index.reset, 50)
        assert f.bootstraps == 2 and index.resets == 2
        assert pub.wait_idle(WAIT_MS / 1000)
        f.catch_up(index.apply, pub.next_seq, index.reset)
        assert index.holders == expected_holders(d2)
        f.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)
