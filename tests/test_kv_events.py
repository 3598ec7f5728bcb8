"""The admitted stream as vLLM KV events (issue 25): vLLM's own classes decode every
message, and a subscriber fed over real ZMQ sockets holds exactly the directory's holder set.

vLLM's ``kv_events.py`` comes out of real wheels (``tests/vllm_events_support.py``): 0.33.0
for tagged maps, 0.20.0 for tagged arrays.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from blendmatch.index import KeyDirectory
from blendmatch.index.holders import HolderWatch
from blendmatch.service.publish import (END_SEQ, EndpointNotAllowed, EventEncoder, KVEventsPublisher, KVEventsSettings,
                                        is_bind_endpoint, is_local_endpoint)
from kv_events_support import WAIT_MS, Subscriber, Workload, expected_holders
from vllm_events_support import decode_batch, vllm_kv_events

CHUNK = 16


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("int_hashes", [False, True])
def test_encoding_is_vllms_byte_for_byte(encoding, int_hashes):
    """Our bytes equal msgspec's encoding of vLLM's own structs, and decode back strictly."""
    V = vllm_kv_events(encoding)
    rng = np.random.default_rng(7)
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(3)]
    tokens = rng.integers(0, 1 << 32, (3, 256), dtype=np.uint64).astype(np.uint32)
    tokens[0, :200] = rng.integers(0, 300, 200)  # every msgpack int width: 1, 2, 3 and 5 bytes
    tokens[1, :5] = [0, 127, 128, 255, 256]
    tokens[1, 5:10] = [65535, 65536, (1 << 32) - 1, 1, 0]
    enc = EventEncoder(encoding, int_hashes)
    ragged = [np.arange(5, dtype=np.uint32), np.arange(300, 307, dtype=np.uint32)]
    payload = enc.batch(1_700_000_123.25, enc.stored(hashes, tokens, "lmcache-l1")
                        + enc.stored(hashes[:2], ragged, "lmcache-l2-redis")
                        + [enc.removed(hashes[:2], "lmcache-l2-redis"), enc.cleared()])

    def wh(h):
        return int.from_bytes(h, "big") & ((1 << 64) - 1) if int_hashes else h

    def stored(h, t, medium):
        return V.BlockStored(block_hashes=[wh(h)], parent_block_hash=None, token_ids=list(map(int, t)),
                             block_size=len(t), lora_id=None, medium=medium, lora_name=None)

    ref = V.KVEventBatch(ts=1_700_000_123.25, data_parallel_rank=0, events=[
        *[stored(h, t, "lmcache-l1") for h, t in zip(hashes, tokens)],
        *[stored(h, t, "lmcache-l2-redis") for h, t in zip(hashes[:2], ragged)],
        V.BlockRemoved(block_hashes=[wh(h) for h in hashes[:2]], medium="lmcache-l2-redis"),
        V.AllBlocksCleared()])
    assert decode_batch(encoding, payload) == ref
    assert payload == msgspec.msgpack.encode(ref)


def test_the_other_encoding_is_refused_by_each_vllm():
    """The two encodings are not interchangeable: each vLLM release rejects the other's
    events (so the flag matters, and the decode test above is not vacuous)."""
    enc_map, enc_arr = EventEncoder("map"), EventEncoder("array")
    for mine, other in ((enc_map, "array"), (enc_arr, "map")):
        payload = mine.batch(1.0, [mine.cleared()])
        with pytest.raises(msgspec.ValidationError):
            decode_batch(other, payload)


def test_endpoint_rules():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("inproc://x")
    assert not is_bind_endpoint("tcp://10.0.0.5:5557") and not is_bind_endpoint("tcp://127.0.0.1:5557")
    assert is_local_endpoint("tcp://127.0.0.1:5557") and is_local_endpoint("tcp://[::1]:5557")
    assert is_local_endpoint("tcp://localhost:1") and is_local_endpoint("ipc:///run/kv")
    assert not is_local_endpoint("tcp://*:5557") and not is_local_endpoint("tcp://10.0.0.5:5557")
    with pytest.raises(EndpointNotAllowed, match="expose = true"):
        KVEventsPublisher(KVEventsSettings(endpoint="tcp://*:5557"))
    with pytest.raises(EndpointNotAllowed):
        KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://0.0.0.0:2"))
    KVEventsPublisher(KVEventsSettings(endpoint="tcp://*:5557", expose=True))  # granted: no error


def _publisher(encoding="map", int_hashes=False, **kw) -> KVEventsPublisher:
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                             encoding=encoding, int_hashes=int_hashes, **kw))
    pub.start()
    return pub


def _directory(pub: KVEventsPublisher) -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=CHUNK, engine="reference")
    d.set_holder_watch(pub.watch)
    return d


@pytest.mark.parametrize("encoding,int_hashes", [("map", False), ("array", True)])
def test_subscriber_holds_exactly_the_directorys_holder_set(encoding, int_hashes):
    """Live SUB (gaps filled by replay) after each phase of a seeded workload, and a SUB that
    joins at the end and replays from seq 0: both hold exactly the directory's holder set."""
    pub = _publisher(encoding, int_hashes)
    ctx = zmq.Context()
    try:
        d = _directory(pub)
        sub = Subscriber(ctx, pub.bound_endpoint, pub.bound_replay_endpoint, encoding)
        work = Workload(seed=25, chunk_size=CHUNK)
        kinds: dict[str, int] = {}
        for phase in range(6):
            work.run(d, 120)
            assert pub.wait_idle(WAIT_MS / 1000)
            sub.catch_up(pub.next_seq - 1)
            assert sub.holders == expected_holders(d, int_hashes), f"phase {phase}"
        for _, _, payload in sub.stream:
            for ev in decode_batch(encoding, payload).events:
                kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1
        # the workload reached every kind of change
        assert kinds.get("BlockStored") and kinds.get("BlockRemoved") and kinds.get("AllBlocksCleared"), kinds
        assert pub.counters["tokenless"] > 0 and pub.counters["dropped"] == 0
        assert sub.live > 0  # the PUB socket carried messages, not only the replays
        topics = {t for t, _, _ in sub.holders}
        assert any(t.startswith("kv@pool:redis@") for t in topics) and any(t.startswith("kv@gpu-") for t in topics)
        assert {m for _, m, _ in sub.holders} >= {"lmcache-l1", "lmcache-l2-redis", "lmcache-l2-disk"}

        late = Subscriber(ctx, pub.bound_endpoint, pub.bound_replay_endpoint, encoding)
        late.replay_from(0)
        assert late.last == pub.next_seq - 1 and late.holders == expected_holders(d, int_hashes)
        assert late.stream == sub.stream  # the same bytes live and replayed
        sub.close()
        late.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_breaking_the_hook_breaks_the_equality():
    """The equality above is not vacuous: a watch that misses fences diverges."""
    pub = _publisher()
    ctx = zmq.Context()
    try:
        d = _directory(pub)

        class NoFences(HolderWatch):
            def after_fence(self, bindings, token):  # forgets what a fence removed
                pass

        broken = NoFences(pub.sink)
        pub.watch = broken
        d.set_holder_watch(broken)
        sub = Subscriber(ctx, pub.bound_endpoint, pub.bound_replay_endpoint, "map")
        Workload(seed=25, chunk_size=CHUNK).run(d, 400)
        assert pub.wait_idle(WAIT_MS / 1000)
        try:
            sub.catch_up(pub.next_seq - 1)
            diverged = sub.holders != expected_holders(d)
        except (AssertionError, KeyError):  # stored twice / removed what it never held
            diverged = True
        assert diverged
    finally:
        pub.stop()
        ctx.destroy(linger=0)


def test_replay_buffer_bad_requests_and_legacy_form():
    pub = _publisher(buffer_steps=5)
    legacy = _publisher(legacy_replay=True)
    ctx = zmq.Context()
    try:
        d, d2 = _directory(pub), _directory(legacy)
        work, work2 = Workload(seed=3, chunk_size=CHUNK), Workload(seed=3, chunk_size=CHUNK)
        work.run(d, 60)
        work2.run(d2, 60)
        assert pub.wait_idle(WAIT_MS / 1000) and legacy.wait_idle(WAIT_MS / 1000)
        assert pub.next_seq > 5
        req = ctx.socket(zmq.DEALER)
        req.connect(pub.bound_replay_endpoint)
        # bad requests: too many frames, a seq that is not 8 bytes, an empty one
        req.send_multipart([b"", b"\x00" * 8, b"extra"])
        req.send_multipart([b"", b"garbage"])
        req.send_multipart([b""])
        req.send_multipart([b"", (0).to_bytes(8, "big")])  # then a good one: the publisher still answers
        got = []
        while True:
            assert req.poll(WAIT_MS)
            frames = req.recv_multipart()
            got.append(frames)
            if frames[2] == END_SEQ:
                break
        # only the last buffer_steps messages are kept: the answer starts there
        seqs = [int.from_bytes(f[2], "big") for f in got[:-1]]
        assert seqs == list(range(pub.next_seq - 5, pub.next_seq))
        assert got[-1] == [b"", b"", END_SEQ, b""]
        assert all(f[1].startswith(b"kv@") for f in got[:-1])
        assert pub.counters["replay_bad_requests"] == 3 and pub.counters["replay_requests"] == 4
        # the legacy form: [b"", seq, payload] and the marker [b"", END_SEQ, b""]
        req2 = ctx.socket(zmq.DEALER)
        req2.connect(legacy.bound_replay_endpoint)
        req2.send_multipart([b"", (legacy.next_seq - 2).to_bytes(8, "big")])
        frames = []
        while not frames or frames[-1][1] != END_SEQ:
            assert req2.poll(WAIT_MS)
            frames.append(req2.recv_multipart())
        assert [len(f) for f in frames] == [3, 3, 3] and frames[-1] == [b"", END_SEQ, b""]
        decode_batch("map", frames[0][2])
        # both publishers saw the same stream: same seqs, same payloads
        assert frames[0][2] == [p for t, s, p in pub._buffer if s == legacy.next_seq - 2][0]
        req.close(0)
        req2.close(0)
    finally:
        pub.stop()
        legacy.stop()
        ctx.destroy(linger=0)


def test_a_full_queue_drops_and_counts_never_blocks():
    """Without a running thread nothing drains the queue: stores past it are dropped and
    counted, their seqs spent (a subscriber sees the gap), and ingest goes on."""
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", max_queue=2))
    d = _directory(pub)
    Workload(seed=1, chunk_size=CHUNK).run(d, 50)
    assert pub.counters["dropped"] > 0
    queued = sum(map(len, pub._queue.queue))  # one item per batch boundary, one message per topic
    assert pub._queue.qsize() == 2 and pub.next_seq == pub.counters["dropped"] + queued


def test_seq_and_counts_round_trip_through_the_checkpoint_section():
    pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*"))
    d = _directory(pub)
    Workload(seed=9, chunk_size=CHUNK).run(d, 80)
    doc = pub.snapshot()
    again = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*"))
    again.restore(doc)
    assert again.next_seq == pub.next_seq > 0 and again.snapshot() == doc
    assert doc["last_ts"] > 1_700_000_000


_STREAM_DIGEST = """
import hashlib, sys
sys.path.insert(0, {tests!r})
from blendmatch.index import KeyDirectory
from blendmatch.service.publish import KVEventsPublisher, KVEventsSettings
from kv_events_support import Workload
pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", buffer_steps=1_000_000))
pub.start()
d = KeyDirectory()
d.enable_blend_lookup(chunk_size=16, engine="reference")
d.set_holder_watch(pub.watch)
Workload(seed=25, chunk_size=16).run(d, 600)
assert pub.wait_idle(60)
digest = hashlib.sha256()
for topic, seq, payload in pub._buffer:
    digest.update(topic + seq.to_bytes(8, "big") + payload)
print(pub.next_seq, digest.hexdigest())
pub.stop()
"""


def test_the_stream_does_not_depend_on_the_hash_seed():
    """Two processes with different hash seeds (set and dict orders differ) publish the
    same bytes for the same applied stream: what replicas rely on."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = _STREAM_DIGEST.format(tests=str(Path(__file__).parent))
    outs = set()
    for seed in ("1", "2", "3"):
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert got.returncode == 0, got.stderr[-2000:]
        outs.add(got.stdout.strip())
    assert len(outs) == 1, outs


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("int_hashes", [False, True])
def test_the_block_kernel_writes_what_the_per_event_encoder_writes(encoding, int_hashes):
    rng = np.random.default_rng(3)
    enc = EventEncoder(encoding, int_hashes)
    for n, length in ((1, 1), (3, 15), (5, 16), (40, 256), (2, 70_000)):
        tokens = rng.integers(0, 1 << 32, (n, length), dtype=np.uint64).astype(np.uint32)
        tokens[:, ::3] = rng.integers(0, 70_000, (n, len(range(0, length, 3))))
        tokens[:, ::5] = rng.integers(0, 200, (n, len(range(0, length, 5))))
        hashes = [rng.bytes(32) for _ in range(n)]
        if int_hashes:
            hashes[0] = b"\x00" * 31 + b"\x05"  # small ints take the short forms
        count, blob = enc.stored_concat(hashes, tokens, "lmcache-l2-redis")
        assert count == n and blob == b"".join(enc.stored(hashes, tokens, "lmcache-l2-redis"))


def test_serve_refuses_an_endpoint_beyond_loopback_without_the_grant(tmp_path):
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--kv-events-endpoint", "tcp://*:5557"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 2 and "expose = true" in got.stderr, got.stderr[-1500:]
    access = tmp_path / "access.toml"
    access.write_text('[kv_events]\nexpose = "yes"\n')
    got = subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--access-file", str(access),
                          "--kv-events-endpoint", "tcp://*:5557"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 2 and "expose must be true or false" in got.stderr, got.stderr[-1500:]


def test_access_file_kv_events_table():
    from blendmatch.service.access import AccessFileError, AccessPolicy

    p = AccessPolicy.from_mapping({"kv_events": {"expose": True, "curve_secret_key_file": "k"}}, source="t")
    assert p.kv_events == {"expose": True, "curve_secret_key_file": "k"}
    assert AccessPolicy.protected_mode().kv_events == {}
    with pytest.raises(AccessFileError, match="kv_events"):
        AccessPolicy.from_mapping({"kv_events": {"expose": True, "bind": "*"}}, source="t")


def test_curve_encrypted_stream_with_a_client_allowlist(tmp_path):
    """With CurveZMQ keys from the access file's table, a listed client with the server's
    public key follows the stream exactly as a plain one does."""
    import zmq.auth

    server_pub, server_secret = zmq.auth.create_certificates(str(tmp_path), "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    client_pub_file, client_secret_file = zmq.auth.create_certificates(str(clients), "router")
    (clients / "router.key_secret").rename(tmp_path / "router.key_secret")  # the directory holds public keys only
    pub = _publisher(curve_secret_key_file=server_secret, curve_clients_dir=str(clients))
    ctx = zmq.Context()
    try:
        d = _directory(pub)
        server_key, _ = zmq.auth.load_certificate(server_pub)
        client_key, client_secret = zmq.auth.load_certificate(str(tmp_path / "router.key_secret"))
        sub = Subscriber.__new__(Subscriber)
        for name, kind, ep in (("sub", zmq.SUB, pub.bound_endpoint), ("req", zmq.DEALER, pub.bound_replay_endpoint)):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = client_secret, client_key, server_key
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(ep)
            setattr(sub, name, s)
        sub.encoding, sub.legacy, sub.last, sub.holders, sub.stream, sub.live, sub.replayed = \
            "map", False, -1, {}, [], 0, 0
        Workload(seed=8, chunk_size=CHUNK).run(d, 150)
        assert pub.wait_idle(WAIT_MS / 1000)
        sub.catch_up(pub.next_seq - 1)
        assert sub.holders == expected_holders(d)
        sub.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_cleared_directory_tells_subscribers_before_the_rebuilt_state(encoding):
    """A Kafka replica's resync clears the directory (``KeyDirectory.clear``) and rebuilds it
    from the new log. Before: subscribers were told nothing and kept every block. Now: one
    ``AllBlocksCleared`` per topic that held blocks (vLLM's class), numbered in order, then
    the rebuilt state; a subscriber ends with exactly the directory's holder set."""
    pub = _publisher(encoding)
    ctx = zmq.Context()
    try:
        d = _directory(pub)
        sub = Subscriber(ctx, pub.bound_endpoint, pub.bound_replay_endpoint, encoding)
        Workload(seed=49, chunk_size=CHUNK).run(d, 150)
        assert pub.wait_idle(WAIT_MS / 1000)
        sub.catch_up(pub.next_seq - 1)
        held_topics = sorted({t for t, _, _ in sub.holders})
        assert len(held_topics) >= 3 and sub.holders == expected_holders(d)
        first_clear = pub.next_seq
        d.clear()  # what the resync does, directory lock held
        assert pub.wait_idle(WAIT_MS / 1000)
        assert pub.next_seq == first_clear + len(held_topics)  # one message per topic that held blocks
        sub.catch_up(pub.next_seq - 1)
        assert sub.holders == {} == expected_holders(d)
        cleared = sub.stream[-len(held_topics):]
        assert [t.decode() for t, _, _ in cleared] == held_topics
        for _, _, payload in cleared:
            assert [type(ev).__name__ for ev in decode_batch(encoding, payload).events] == ["AllBlocksCleared"]
        Workload(seed=50, chunk_size=CHUNK).run(d, 60)  # the rebuilt state follows
        assert pub.wait_idle(WAIT_MS / 1000)
        sub.catch_up(pub.next_seq - 1)
        assert sub.holders and sub.holders == expected_holders(d)
        sub.close()
    finally:
        pub.stop()
        ctx.destroy(linger=0)
