"""The KV-events publisher holds a bounded number of bytes whatever its peers do (issue 47):
a replay flood from clients that never read, store/delete cycles, subscribers that never
read, a queue that is not drained, one huge batch, and a flood of malformed requests.

Real ZMQ sockets against a real publisher in-process; messages are decoded by vLLM's own
``KVEventBatch`` out of its wheel (``tests/vllm_events_support.py``). Clients that "never
read" set a receive high-water mark of one message and a 4 KB kernel buffer, so what they
would have buffered on their side does not count as the publisher's memory. Memory is
measured as this process's RSS (the publisher's copies show there) and, where the code
has one, by the publisher's own byte gauge.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import zmq

from blendmatch.index import KeyDirectory
from blendmatch.index.holders import HolderChanges, Spot, StoredChunks
from blendmatch.service.publish import END_SEQ, KVEventsPublisher, KVEventsSettings
from kv_events_support import WAIT_MS
from vllm_events_support import decode_batch

MiB = 1 << 20
TOKENS = 256  # a chunk's tokens; about 1 KB each on the wire


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _changes(k: int, chunks: int, *, holder: str = "gpu-a", seed: int = 0) -> HolderChanges:
    """One batch boundary that stores ``chunks`` new chunks on ``holder``'s L1: one message
    of about ``chunks`` KB (tokens under 60,000: 3 bytes each)."""
    rng = np.random.default_rng(seed * 1_000_003 + k)
    tokens = rng.integers(256, 60_000, size=(chunks, TOKENS), dtype=np.uint32)
    hashes = [k.to_bytes(8, "big") + j.to_bytes(8, "big") for j in range(chunks)]
    spot = Spot(holder, "llama", "l1", "cpu", False)
    return HolderChanges(1_700_000_000.0 + k, None, {}, {}, {spot: StoredChunks(hashes, tokens)}, 0)


def _fill(pub: KVEventsPublisher, messages: int, chunks: int) -> None:
    for k in range(messages):
        pub.sink(_changes(k, chunks))
    assert pub.wait_idle(WAIT_MS / 1000)


def _deaf(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    """A socket that never reads and takes (almost) nothing off the wire."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _replay_all(ctx: zmq.Context, endpoint: str, start: int = 0) -> list[list[bytes]]:
    """A client that reads: every frame set up to and including the end marker."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    try:
        while True:
            assert req.poll(WAIT_MS), "no replay answer"
            frames = req.recv_multipart()
            got.append(frames)
            if frames[2] == END_SEQ:
                return got
    finally:
        req.close(0)


def _until(check, timeout: float = WAIT_MS / 1000) -> bool:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _publisher(**kw) -> KVEventsPublisher:
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", **kw))
    pub.start()
    return pub


def test_a_replay_flood_is_bounded_in_bytes_and_returned_when_clients_leave():
    """The issue's flood, scaled down: a ring of 100 messages of ~35 KB (under pyzmq's 64 KB
    copy threshold), 6 DEALERs sending 10 "replay from 0" each and never reading. The old
    publisher copied the whole ring per request into each client's queue (~210 MB here);
    now each client holds at most its budget, clients past --kv-events-max-replays are
    answered with the end marker alone, and when the clients leave their bytes and slots
    come back: the next client gets the whole replay."""
    pub = _publisher(replay_client_bytes=1 * MiB, replay_bytes=4 * MiB, max_replays=4)
    ctx = zmq.Context()
    clients: list[zmq.Socket] = []
    try:
        _fill(pub, 100, 36)
        ring = sum(len(p) for _, _, p in pub._buffer)
        assert len(pub._buffer) == 100 and 3 * MiB < ring < 5 * MiB
        assert len(_replay_all(ctx, pub.bound_replay_endpoint)) == 101  # warm: pyzmq's threads, buffers
        before = _rss()
        for _ in range(6):
            sock = _deaf(ctx, zmq.DEALER, pub.bound_replay_endpoint)
            for _ in range(10):
                sock.send_multipart([b"", (0).to_bytes(8, "big")])
            clients.append(sock)
        assert _until(lambda: pub.counters["replay_requests"] >= 61)
        time.sleep(1.0)  # let the publisher queue what it will
        grown = _rss() - before
        assert grown < 40 * MiB, f"RSS grew {grown / MiB:.0f} MiB under the flood (budget 4 MiB)"
        held = pub.held_bytes()["replay_clients"]
        assert 0 < held <= 4 * MiB + 64 * 1024, held
        assert 1 <= pub.stats()["replay_clients"] <= 4
        assert pub.counters["replay_refused"] >= 20  # two clients past the bound, 10 requests each
        # the live stream goes on meanwhile
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.bound_endpoint)
        time.sleep(0.3)  # the slow joiner
        pub.sink(_changes(100, 4))
        assert sub.poll(WAIT_MS) and int.from_bytes(sub.recv_multipart()[1], "big") == 100
        sub.close(0)
        for sock in clients:
            sock.close(0)
        clients.clear()
        # every slot comes back; libzmq may keep the last message written to a connection a while
        assert _until(lambda: pub.held_bytes()["replay_clients"] <= 64 * 1024 and pub.stats()["replay_clients"] == 0), \
            pub.stats()
        got = _replay_all(ctx, pub.bound_replay_endpoint)
        assert [int.from_bytes(f[2], "big") for f in got[:-1]] == list(range(101))
    finally:
        for sock in clients:
            sock.close(0)
        pub.stop()
        ctx.destroy(linger=0)


def test_a_client_past_the_bound_gets_the_end_marker_and_a_slot_once_one_leaves():
    pub = _publisher(max_replays=1, replay_client_bytes=64 * 1024, replay_bytes=64 * 1024)
    ctx = zmq.Context()
    try:
        _fill(pub, 20, 36)
        stuck = _deaf(ctx, zmq.DEALER, pub.bound_replay_endpoint)
        stuck.send_multipart([b"", (0).to_bytes(8, "big")])
        assert _until(lambda: pub.stats()["replay_clients"] == 1)
        got = _replay_all(ctx, pub.bound_replay_endpoint)
        assert got == [[b"", b"", END_SEQ, b""]]  # refused: the end marker alone
        assert pub.counters["replay_refused"] == 1
        stuck.close(0)
        assert _until(lambda: pub.stats()["replay_clients"] == 0)
        assert len(_replay_all(ctx, pub.bound_replay_endpoint)) == 21
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_store_delete_cycles_keep_the_replay_ring_within_its_bytes():
    """The same 40 chunks stored and deleted 150 times (the index stays empty): each round
    is two messages of ~40 KB and 300 B; the ring keeps 10,000 messages by default, so it
    grew by each round. Bounded in bytes, it keeps the newest that fit."""
    pub = _publisher(buffer_bytes=2 * MiB)
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=TOKENS, engine="reference")
    d.set_holder_watch(pub.watch)
    rng = np.random.default_rng(47)
    hashes = [rng.bytes(16) for _ in range(40)]
    rows = rng.integers(0, 60_000, size=(40, TOKENS)).tolist()
    try:
        for rnd in range(150):
            for kind in ("store", "delete"):
                entries = [{"key": {"chunk_hash_hex": h.hex(), "model_name": "llama", "kv_rank": 0},
                            "size_bytes": 1000} for h in hashes]
                if kind == "store":
                    for k, e in enumerate(entries):
                        e["token_ids"], e["token_offset"] = rows[k], TOKENS * k
                d.apply({"batches": [{"instance_id": "gpu-a", "incarnation": 0, "seq": 2 * rnd + (kind == "delete") + 1,
                                      "event_type": kind, "tier": "l1", "backend": "cpu", "shared": False,
                                      "ts": 1_700_000_000.0 + rnd, "entries": entries}]})
        assert pub.wait_idle(WAIT_MS / 1000)
        assert pub.next_seq == 300 and d.stats()["keys"] == 0
        kept = sum(len(p) + len(t) for t, _, p in pub._buffer)
        assert kept <= 2 * MiB, f"the replay ring holds {kept / MiB:.1f} MiB (budget 2 MiB)"
        assert pub.held_bytes()["replay_buffer"] <= 2 * MiB
        # what it kept is the newest, contiguous, and replays as such
        seqs = [s for _, s, _ in pub._buffer]
        assert seqs == list(range(300 - len(seqs), 300)) and len(seqs) > 50
    finally:
        pub.stop()


def test_subscribers_that_never_read_hold_bounded_bytes():
    """Three SUBs that never read, 800 messages of ~35 KB (28 MB): ZMQ's high-water mark
    counts messages (100,000 by default), so their queues held every message. With
    --kv-events-subscriber-bytes 1 MiB and 64 KB messages the mark is 16 messages."""
    pub = _publisher(buffer_steps=1, subscriber_bytes=1 * MiB, max_message_bytes=64 * 1024)
    ctx = zmq.Context()
    try:
        _fill(pub, 5, 36)  # warm up
        subs = [_deaf(ctx, zmq.SUB, pub.bound_endpoint) for _ in range(3)]
        time.sleep(0.3)  # the slow joiner
        before = _rss()
        _fill(pub, 800, 36)
        time.sleep(0.5)
        grown = _rss() - before
        assert grown < 12 * MiB, f"RSS grew {grown / MiB:.0f} MiB with 3 subscribers that never read"
        assert pub.stats()["pub_hwm"] == 16
        # shared between the subscribers (counted once): at most one queue's worth, plus one
        assert pub.held_bytes()["subscribers"] <= 1 * MiB + 64 * 1024
        for sub in subs:
            sub.close(0)
        # libzmq may keep the last message written to a connection until its next one
        assert _until(lambda: pub.held_bytes()["subscribers"] <= 64 * 1024), pub.held_bytes()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_the_publish_queue_is_bounded_in_bytes_and_drops_leave_a_seq_gap():
    """Nothing drains the queue (the thread is not started): batches of 512 KB of token
    rows each; by the default 64 MiB bound about 100 fit, the rest are dropped and counted,
    their seqs spent. The queue used to count items only (100,000)."""
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*"))
    for k in range(300):
        pub.sink(_changes(k, 512))
    held = sum(spec[2].nbytes for item in pub._queue.queue for msg in item for spec in msg[3])
    assert held <= 64 * MiB, f"the queue holds {held / MiB:.0f} MiB of token rows"
    assert pub.counters["dropped"] > 0 and pub.held_bytes()["queue"] <= 64 * MiB
    queued = sum(map(len, pub._queue.queue))
    assert pub.next_seq == pub.counters["dropped"] + queued  # each drop is a seq a subscriber sees missing


def test_a_batch_over_the_message_bound_is_split_and_decodes_whole():
    """One batch of 300 chunks (~300 KB encoded) with 64 KB messages: several messages,
    each within the bound, consecutive seqs, and together every chunk (vLLM's classes)."""
    pub = _publisher(max_message_bytes=64 * 1024)
    ctx = zmq.Context()
    try:
        changes = _changes(0, 300)
        pub.sink(changes)
        assert pub.wait_idle(WAIT_MS / 1000)
        got = _replay_all(ctx, pub.bound_replay_endpoint)[:-1]
        assert len(got) >= 5
        assert [int.from_bytes(f[2], "big") for f in got] == list(range(len(got)))
        assert all(len(f[3]) <= 64 * 1024 for f in got)
        stored = [h for f in got for ev in decode_batch("map", f[3]).events for h in ev.block_hashes]
        assert stored == next(iter(changes.stored.values())).hashes
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_malformed_replay_frames_log_a_line_per_kind(caplog):
    """5,000 bad requests of two kinds: every one counted, at most one WARNING per kind."""
    pub = _publisher()
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.bound_replay_endpoint)
        with caplog.at_level(logging.WARNING, logger="blendmatch.service.publish"):
            for k in range(2500):
                req.send_multipart([b"", b"garbage"])
                req.send_multipart([b"", b"\x00" * 8, b"extra"])
            assert _until(lambda: pub.counters["replay_bad_requests"] == 5000), pub.counters
        lines = [r for r in caplog.records if "bad replay request" in r.getMessage()]
        assert 1 <= len(lines) <= 2, f"{len(lines)} log lines for 5,000 bad requests"
        assert {r.levelno for r in lines} == {logging.WARNING}
        req.close(0)
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_the_byte_gauges_are_exported():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"),
                            registry=registry)
    pub.start()
    try:
        _fill(pub, 3, 8)
        for buffer in ("queue", "replay_buffer", "subscribers", "replay_clients"):
            value = registry.get_sample_value("blendmatch_kv_events_bytes", {"buffer": buffer})
            assert value is not None and value >= 0, buffer
        assert registry.get_sample_value("blendmatch_kv_events_bytes", {"buffer": "replay_buffer"}) > 0
        assert registry.get_sample_value("blendmatch_kv_events_replay_clients") == 0
    finally:
        pub.stop()
