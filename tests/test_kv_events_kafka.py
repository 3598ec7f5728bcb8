"""KV events from a Kafka fleet (issue 25): two replicas following one topic publish
byte-identical streams, and a replica SIGKILLed and restarted from its checkpoint continues
its seq: a subscriber sees no gap and no repeat.

The replicas bind their sockets beyond loopback (``tcp://*:PORT``) under an access file
that grants it (``[kv_events] expose = true``), so the restart keeps the endpoints and a
router's sockets reconnect by themselves.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import zmq

from blendmatch.index import KeyDirectory
from blendmatch.service.sources.records import lmcache_record_value
from kafka_support import (Replica, create_topic, end_offsets, free_port, kafka_bootstrap,  # noqa: F401
                           lmcache_producer, wait_for)
from kv_events_support import WAIT_MS, Subscriber, Workload, expected_holders
from vllm_events_support import kv_events_file, RELEASES

C = 16


def _produce(producer, topic, batches, positions, pace_s=0.0):
    def done(err, msg):
        assert err is None, err
        positions.append((msg.partition(), msg.offset()))

    for b in batches:
        producer.produce(topic, key=b["instance_id"].encode(), value=lmcache_record_value(b), on_delivery=done)
        producer.poll(0)
        if pace_s:
            time.sleep(pace_s)
    assert producer.flush(10) == 0


def _batches(seed: int, n: int) -> list[dict]:
    work = Workload(seed, C)
    rng = work.rng
    return [work.batch(rng.choice(work.instances)) for _ in range(n)]


def _raw_replay(ctx, r: dict) -> list[tuple[bytes, int, bytes]]:
    """Every message a replica's replay buffer holds, as sent."""
    req = ctx.socket(zmq.DEALER)
    req.connect(r["replay"])
    req.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        assert req.poll(WAIT_MS), "no replay answer"
        _, topic, seq_b, payload = req.recv_multipart()
        if seq_b == (-1).to_bytes(8, "big", signed=True):
            req.close(0)
            return out
        out.append((topic, int.from_bytes(seq_b, "big"), payload))


def _full_stream(ctx, r: dict) -> Subscriber:
    s = Subscriber(ctx, r["pub"], r["replay"], "map")
    s.replay_from(0)
    s.close()
    return s


@pytest.mark.kafka
def test_replicas_publish_identical_streams_and_a_restart_continues_the_seq(kafka_bootstrap, tmp_path):
    kv_events_file(RELEASES["map"])  # vLLM's classes (skips with the reason when they cannot be fetched)
    access = tmp_path / "access.toml"
    access.write_text('[[network]]\nname = "here"\ncidrs = ["127.0.0.0/8"]\n'
                      'roles = ["producer", "reader", "admin", "metrics"]\n\n[kv_events]\nexpose = true\n')
    topic = create_topic(kafka_bootstrap, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    ports = {name: (free_port(), free_port()) for name in ("a", "b")}
    reps, eps = [], {}
    for name in ("a", "b"):
        pub, rep = ports[name]
        eps[name] = {"pub": f"tcp://127.0.0.1:{pub}", "replay": f"tcp://127.0.0.1:{rep}"}
        reps.append(Replica(kafka_bootstrap, topic, name, group, str(tmp_path / f"{name}.ckpt"),
                            "--access-file", str(access), "--checkpoint-interval", "0.2",
                            "--health-check-interval", "0", "--kv-events-endpoint", f"tcp://*:{pub}",
                            "--kv-events-replay-endpoint", f"tcp://*:{rep}", chunk_size=C,
                            log_path=tmp_path / f"{name}.log"))
    ctx = zmq.Context()
    try:
        first, second = _batches(11, 150), _batches(12, 150)
        # the second half continues the first's instances: renumber its seqs after the first's
        last = {}
        for b in first:
            last[b["instance_id"]] = (b["incarnation"], b["seq"])
        for b in second:
            inc, seq = last.get(b["instance_id"], (0, 0))
            b["incarnation"] = max(b["incarnation"], inc)
            b["seq"] = seq + 1 if b["incarnation"] == inc else 1
            last[b["instance_id"]] = (b["incarnation"], b["seq"])
        producer = lmcache_producer(kafka_bootstrap)
        positions: list = []
        _produce(producer, topic, first, positions)
        for r in reps:
            r.wait_up()
        want = end_offsets(positions)
        for r in reps:
            r.wait_position(want)
        stats_b = reps[1].client.get("/directory/stats").json()["blendmatch"]["kv_events"]
        assert stats_b["next_seq"] > 0 and stats_b["dropped"] == 0

        # a router following b: live SUB, gaps filled by replay
        follower = Subscriber(ctx, eps["b"]["pub"], eps["b"]["replay"], "map")
        follower.catch_up(stats_b["next_seq"] - 1)
        assert follower.last == stats_b["next_seq"] - 1

        # SIGKILL b mid-stream; restart it from its checkpoint
        feeder = threading.Thread(target=_produce, args=(producer, topic, second, positions, 0.005))
        feeder.start()
        time.sleep(0.3)
        reps[1].kill()
        feeder.join()
        reps[1] = reps[1].restart()
        reps[1].wait_up()
        # /healthz answers while the checkpoint is still being restored on the events thread
        # (by design: alive, not ready); the seq it resumed from is known once it is restored
        wait_for(lambda: "restoring checkpoint" not in reps[1].client.get("/readyz").json().get("reasons", []),
                 30, "b's checkpoint restore")
        restarted_from = reps[1].client.get("/directory/stats").json()["blendmatch"]["kv_events"]
        want = end_offsets(positions)
        for r in reps:
            r.wait_position(want)
        a_stream = _full_stream(ctx, eps["a"])
        b_new = _raw_replay(ctx, eps["b"])  # what the restarted b has published (from its checkpoint on)
        total = a_stream.last + 1

        # byte-identical: a's whole stream; the restarted b's, seq for seq, is its tail
        assert b_new and b_new == a_stream.stream[b_new[0][1]:]
        first_again = b_new[0][1]
        assert first_again > 0  # it resumed its seq from the checkpoint, not from 0
        assert restarted_from["next_seq"] >= first_again
        assert b_new[-1][1] == total - 1

        # the router that followed b continues without a gap or a repeat (apply asserts
        # seq == last + 1 and skips seqs it has seen)
        if first_again > follower.last + 1:  # b's checkpoint is ahead of what reached us: fail over to a
            follower.req.close(0)
            follower.req = ctx.socket(zmq.DEALER)
            follower.req.connect(eps["a"]["replay"])
            follower.replay_from(follower.last + 1)
            follower.req.close(0)
            follower.req = ctx.socket(zmq.DEALER)
            follower.req.connect(eps["b"]["replay"])
        follower.catch_up(total - 1)
        assert [s for _, s, _ in follower.stream] == list(range(total))
        assert follower.stream == a_stream.stream

        # and what it holds is the directory's holder set (an in-process directory, same log)
        ref = KeyDirectory()
        ref.enable_blend_lookup(chunk_size=C, engine="reference")
        for b in first + second:
            ref.apply({"batches": [b]})
        assert follower.holders == a_stream.holders == expected_holders(ref)
        follower.close()
    finally:
        ctx.destroy(linger=0)
        for r in reps:
            r.stop()


@pytest.mark.kafka
def test_a_router_switches_replica_mid_snapshot_and_ends_exact(kafka_bootstrap, tmp_path):
    """Two replicas at the same position send the same snapshot bytes: a router reads part
    of a's snapshot, loses a, takes b's from the start (its first pages are a's, byte for
    byte), then follows b live while more is ingested, and holds exactly the holder set."""
    from test_kv_events_snapshot import Index, SNAPSHOT_SEQ
    from blendmatch.service.publish.follower import KVEventsFollower

    kv_events_file(RELEASES["map"])
    topic = create_topic(kafka_bootstrap, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    reps, eps = [], {}
    for name in ("a", "b"):
        pub, rep = free_port(), free_port()
        eps[name] = {"pub": f"tcp://127.0.0.1:{pub}", "replay": f"tcp://127.0.0.1:{rep}"}
        reps.append(Replica(kafka_bootstrap, topic, name, group, str(tmp_path / f"{name}.ckpt"),
                            "--health-check-interval", "0", "--kv-events-endpoint", eps[name]["pub"],
                            "--kv-events-replay-endpoint", eps[name]["replay"], "--kv-events-buffer-steps", "5",
                            "--kv-events-snapshot-page-blocks", "3", chunk_size=C,
                            log_path=tmp_path / f"{name}.log"))
    ctx = zmq.Context()
    try:
        first, second = _batches(21, 200), _batches(22, 100)
        for b in second:  # other instances' names: no seq bookkeeping across the halves
            b["instance_id"] = "late-" + b["instance_id"]
        producer = lmcache_producer(kafka_bootstrap)
        positions: list = []
        _produce(producer, topic, first, positions)
        for r in reps:
            r.wait_up()
        want = end_offsets(positions)
        for r in reps:
            r.wait_position(want)

        # part of a's snapshot, then a is gone (the router drops its socket)
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(eps["a"]["replay"])
        req.send_multipart([b"", SNAPSHOT_SEQ.to_bytes(8, "big")])
        from_a = []
        for _ in range(5):
            assert req.poll(WAIT_MS)
            from_a.append(req.recv_multipart())
        assert all(f[2] != (-1).to_bytes(8, "big", signed=True) for f in from_a)  # mid-snapshot
        req.close(0)
        reps[0].stop()

        index = Index("map")
        f = KVEventsFollower(eps["b"]["pub"], eps["b"]["replay"], ctx=ctx)
        seen = []
        n = f.bootstrap(lambda t, s, p: (seen.append([b"", t, s.to_bytes(8, "big"), p]), index.apply(t, s, p)),
                        index.reset)
        assert seen[:5] == from_a  # the same bytes on both replicas at the same position
        _produce(producer, topic, second, positions)
        reps[1].wait_position(end_offsets(positions))
        total = reps[1].client.get("/directory/stats").json()["blendmatch"]["kv_events"]["next_seq"]
        assert total > n
        f.catch_up(index.apply, total, index.reset)
        ref = KeyDirectory()
        ref.enable_blend_lookup(chunk_size=C, engine="reference")
        for b in first + second:
            ref.apply({"batches": [b]})
        assert index.holders == expected_holders(ref)
        f.close()
    finally:
        ctx.destroy(linger=0)
        for r in reps:
            r.stop()
