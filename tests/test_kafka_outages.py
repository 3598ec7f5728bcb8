"""A bad day for the fleet transport, against a real broker (tansu) (issue 23, items 1-3 and
the catch-up part of 12): a broker outage of about 20 s, a broker that comes back without its
log, a producer whose broker lost its state, a replica started cold, and the bound on
instance ids when the registry and events go through the log.

Each test has a broker of its own (``kafka_support.broker``: tansu behind a TCP relay that
can be cut, so an outage keeps the log; a restart of tansu itself loses it, its storage
being in memory). Marked ``kafka``; skipped only when the broker cannot start.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from blendmatch.service.sources.records import lmcache_record_value
from kafka_support import Replica, broker, create_topic, end_offsets, lmcache_producer, wait_for  # noqa: F401
from service_support import chunks, metric_samples, store

pytestmark = pytest.mark.kafka

#: The outage of the issue: longer than the metadata refresh period plus its timeout (10 s
#: each), so that a refresh starts and fails inside it.
OUTAGE_S = 20.0


def _records(instance: str, seqs: range, seed: int) -> list[tuple[bytes, bytes]]:
    """One single-chunk STORE record per seq, distinct content and hash per (instance, seq)."""
    base = seed * 1_000_000
    return [(instance.encode(), lmcache_record_value(store(instance, s, chunks(1, seed=base + s),
                                                            first_hash=base + s, incarnation=1)))
            for s in seqs]


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> list[tuple[int, int]]:
    """Append with a fresh LMCache-configured producer; the (partition, offset) of each."""
    producer = lmcache_producer(bootstrap)
    positions: list[tuple[int, int]] = []

    def done(err: Any, msg: Any) -> None:
        assert err is None, err
        positions.append((msg.partition(), msg.offset()))

    for key, value in records:
        producer.produce(topic, key=key, value=value, on_delivery=done)
        producer.poll(0)
    assert producer.flush(15) == 0
    return positions


def _metrics(r: Replica) -> dict[str, float]:
    return metric_samples(r.client.get("/metrics").text)


def _total(m: dict[str, float], name: str) -> float:
    """A counter summed over its labels."""
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def _keys(r: Replica) -> int:
    return r.client.get("/directory/stats").json()["num_keys"]


def _replica(broker: Any, topic: str, name: str, tmp_path: Any, *extra: str, ckpt: bool = True) -> Replica:
    return Replica(broker.bootstrap, topic, name, f"g-{uuid.uuid4().hex[:8]}",
                   str(tmp_path / f"{name}.ckpt") if ckpt else "", "--checkpoint-interval", "0.5", *extra,
                   log_path=tmp_path / f"{name}.log")


# ---------------------------------------------------------------------- item 1: outages
def test_a_broker_outage_is_survived_and_consumption_resumes(broker, tmp_path):
    """Today: the periodic metadata refresh raised during the outage, nothing caught it, the
    consumer thread died and the replica applied 0 of the new records while /healthz said
    200. Now: retried with backoff, counted, and the replica applies what came after; a
    replica started during the outage comes up and catches up too."""
    topic = create_topic(broker.bootstrap)
    a = _replica(broker, topic, "a", tmp_path)
    late = None
    try:
        first = _produce(broker.bootstrap, topic, _records("mp-0", range(1, 21), seed=1))
        a.wait_up()
        a.wait_position(end_offsets(first))
        assert _keys(a) == 20

        broker.cut()
        t0 = time.monotonic()
        late = _replica(broker, topic, "late", tmp_path, ckpt=False)
        late.wait_up()
        while time.monotonic() - t0 < OUTAGE_S:
            for r in (a, late):  # alive through the outage: no orchestrator restart is needed
                assert r.client.get("/healthz").status_code == 200
            time.sleep(1.0)
        ready = a.client.get("/readyz").json()
        assert "unreachable" in " ".join(ready.get("warnings", []) + ready.get("reasons", [])), ready
        broker.restore()

        second = _produce(broker.bootstrap, topic, _records("mp-0", range(21, 71), seed=1))
        want = end_offsets(first + second)
        for r in (a, late):
            r.wait_position(want, timeout=60)
            wait_for(lambda r=r: r.client.get("/readyz").status_code == 200, 30, f"{r.replica_id} to be ready")
            assert _keys(r) == 70
            assert r.client.get("/healthz").status_code == 200
        m = _metrics(a)
        assert _total(m, "blendmatch_kafka_broker_errors_total") >= 1
        assert _total(m, "blendmatch_kafka_reconnects_total") >= 1
        assert a.log_stats()["error"] is None and a.log_stats()["records_applied"] == 70
    finally:
        for r in (a, late):
            if r is not None:
                r.stop()


# ---------------------------------------------------------------------- item 12: a cold start
def test_a_replica_without_checkpoint_is_ready_only_at_the_log_end(broker, tmp_path):
    """Today: ready as soon as its lag was within --max-ready-lag (1,000 records), with the
    rest of its peers' answers missing. Now: not ready until it reached the high watermark
    it saw at start, and /readyz says so meanwhile."""
    topic = create_topic(broker.bootstrap)
    n = 1500
    recs = [(b"mp-0", lmcache_record_value(store("mp-0", s, chunks(40, seed=s), first_hash=s * 100, incarnation=1)))
            for s in range(1, n + 1)]
    end = end_offsets(_produce(broker.bootstrap, topic, recs))
    r = _replica(broker, topic, "cold", tmp_path, ckpt=False)
    try:
        r.wait_up()
        reasons: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = r.client.get("/readyz")
            if got.status_code == 200:
                break
            reasons += got.json()["reasons"]
            time.sleep(0.01)
        assert got.status_code == 200, reasons[-3:]
        # read after /readyz said ready: the position only grows, so it was reached then
        assert r.log_stats()["position"] == end
        assert reasons  # it was not ready at first
        assert any("catching up to the log's end" in x for x in reasons) or all("unknown" in x for x in reasons)
    finally:
        r.stop()


# ---------------------------------------------------------------------- item 2: log loss
def _recreate_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """The operator's (or a producer's) new topic of the same name; the replica may have
    recreated it first (it creates a missing topic with one partition)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(10)
    except KafkaException as exc:
        assert exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS and partitions == 1, exc


def _lookup(r: Replica, rows: Any) -> list:
    got = r.client.post("/directory/blend-lookup", json={"token_ids": rows.reshape(-1).tolist(), "model_name": "llama"})
    assert got.status_code == 200, got.text
    return got.json()["matches"]


def test_a_broker_that_lost_its_log_is_detected_and_resync_rebuilds(broker, tmp_path):
    """Today: after the broker came back empty, the replica at position 30 applied the new
    log's records 30-39 as if they followed its own, skipped 0-29 as "already applied",
    kept the old chunks and said ready. Now: the reset is detected and counted, and with
    --on-log-reset resync the replica forgets the old state and rebuilds from the new log."""
    topic = create_topic(broker.bootstrap)
    r = _replica(broker, topic, "rs", tmp_path, "--on-log-reset", "resync")
    try:
        old = _produce(broker.bootstrap, topic, _records("mp-old", range(1, 31), seed=2))
        r.wait_up()
        r.wait_position(end_offsets(old))
        assert r.client.post("/instances", json={"instance_id": "mp-reg", "ip": "10.0.0.1",
                                                 "http_port": 80}).status_code == 200
        old_rows = chunks(1, seed=2_000_000 + 5)
        assert len(_lookup(r, old_rows)) == 1

        broker.restart_empty()
        _recreate_topic(broker.bootstrap, topic)
        new = _produce(broker.bootstrap, topic, _records("mp-new", range(1, 41), seed=3))  # longer than 30
        assert end_offsets(new) == {"0": 40}

        def rebuilt() -> bool:
            ls = r.log_stats()
            return ls["log_resets"] >= 1 and ls["log_reset"] is None and ls["position"] == {"0": 40}

        wait_for(rebuilt, 60, "the resync to rebuild from the new log")
        wait_for(lambda: r.client.get("/readyz").status_code == 200, 30, "ready after the resync")
        assert _keys(r) == 40
        assert _lookup(r, old_rows) == []  # the old log's chunks are gone with it
        assert len(_lookup(r, chunks(1, seed=3_000_000 + 7))) == 1
        assert r.client.get("/instances").json()["instances"] == []
        assert _total(_metrics(r), "blendmatch_kafka_log_resets_total") >= 1
        assert r.client.get("/healthz").status_code == 200
        ls = r.log_stats()
        assert ls["records_skipped"] == 0
    finally:
        r.stop()


def test_a_broker_that_lost_its_log_fails_loudly_by_default(broker, tmp_path):
    """--on-log-reset fail (the default): the replica stops following, applies nothing of
    the new log, and both probes answer 503 with the reason."""
    topic = create_topic(broker.bootstrap)
    r = _replica(broker, topic, "rf", tmp_path)
    try:
        old = _produce(broker.bootstrap, topic, _records("mp-old", range(1, 31), seed=2))
        r.wait_up()
        r.wait_position(end_offsets(old))
        broker.restart_empty()
        _recreate_topic(broker.bootstrap, topic)
        _produce(broker.bootstrap, topic, _records("mp-new", range(1, 11), seed=3))  # shorter than 30

        health = wait_for(lambda: (h := r.client.get("/healthz")).status_code == 503 and h, 60, "healthz to fail")
        assert "event log reset" in health.json()["reason"] and "--on-log-reset fail" in health.json()["reason"]
        ready = r.client.get("/readyz")
        assert ready.status_code == 503 and any("event log reset" in x for x in ready.json()["reasons"])
        assert _keys(r) == 30 and r.log_stats()["position"] == {"0": 30}  # nothing of the new log applied
        assert _total(_metrics(r), "blendmatch_kafka_log_resets_total") == 1
    finally:
        r.stop()


# ---------------------------------------------------------------------- item 3: appends
def _timed(call) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    got = call()
    return time.monotonic() - t0, got


def test_appends_answer_within_the_bound_and_a_broken_producer_is_replaced(broker, tmp_path):
    """Today: with the broker down, POST /events and POST /instances took 30 s to answer
    503; after the broker came back without its producer state, every append timed out
    for good. Now: a 503 naming --kafka-produce-timeout within the bound, and appends work
    again once the broker is back, through a new producer where the old one broke."""
    bound = 2.0
    slack = 3.0  # HTTP, the event loop and a loaded machine
    topic = create_topic(broker.bootstrap)
    r = _replica(broker, topic, "p", tmp_path, "--kafka-produce-timeout", str(bound), "--on-log-reset", "resync")
    body = lambda seq: {"batches": [store("mp-http", seq, chunks(1, seed=seq), first_hash=seq, incarnation=1)]}  # noqa: E731
    try:
        r.wait_up()
        wait_for(lambda: r.client.post("/events", json=body(1)).status_code == 200, 30, "a first append")

        broker.cut()
        for call in (lambda: r.client.post("/events", json=body(2)),
                     lambda: r.client.post("/instances", json={"instance_id": "mp-r", "ip": "10.0.0.1", "http_port": 80})):
            took, got = _timed(call)
            assert got.status_code == 503 and took < bound + slack, (took, got.text)
            assert "--kafka-produce-timeout" in got.json()["detail"], got.text
        broker.restore()

        def appends() -> bool:
            took, got = _timed(lambda: r.client.post("/events", json=body(3)))
            assert took < bound + slack, (took, got.text)
            return got.status_code == 200

        wait_for(appends, 60, "appends to work after the outage", every=0.2)

        broker.restart_empty()  # the broker forgot every producer id
        _recreate_topic(broker.bootstrap, topic)
        seq = iter(range(4, 1000))
        wait_for(lambda: _timed(lambda: r.client.post("/events", json=body(next(seq))))[1].status_code == 200, 60,
                 "appends to work after the broker came back empty", every=0.2)
        for _ in range(3):  # and keep working, each within the bound
            took, got = _timed(lambda: r.client.post("/events", json=body(next(seq))))
            assert got.status_code == 200 and took < bound + slack, (took, got.text)
        m = _metrics(r)
        assert _total(m, "blendmatch_kafka_append_failures_total") >= 2
        assert _total(m, "blendmatch_kafka_producer_renewals_total") >= 1
        assert r.client.get("/healthz").status_code == 200
    finally:
        r.stop()


# ---------------------------------------------------------------------- --max-instances
def test_max_instances_bounds_appends_as_in_http_mode(broker, tmp_path):
    """Today: in Kafka mode POST /events appended events for any number of new instance
    ids. Now: the HTTP-mode rule (tests/test_http_limits.py), checked before anything is
    appended, against this replica's applied state; registrations likewise."""
    topic = create_topic(broker.bootstrap)
    r = _replica(broker, topic, "mi", tmp_path, "--max-instances", "3")
    try:
        r.wait_up()
        for i in range(3):
            got = r.client.post("/events", json={"batches": [store(f"inst-{i}", 1, chunks(1, seed=i), first_hash=i)]})
            assert got.status_code == 200, got.text
        r.wait_position({"0": 3})
        before = r.log_stats()["position"]
        got = r.client.post("/events", json={"batches": [store("inst-0", 2, chunks(1, seed=10), first_hash=10),
                                                         store("inst-new", 1, chunks(1, seed=11), first_hash=11)]})
        assert got.status_code == 429, got.text
        assert "--max-instances" in got.json()["detail"] and "nothing was appended" in got.json()["detail"]
        got = r.client.post("/events", json={"batches": [store("inst-0", 2, chunks(1, seed=10), first_hash=10)]})
        assert got.status_code == 200, got.text  # known ids go on
        r.wait_position({"0": before["0"] + 1})
        assert r.log_stats()["position"] == {"0": before["0"] + 1}  # the refused request appended nothing
        assert len(r.client.get("/directory/stats").json()["blendmatch"]["instances"]) == 3
        for i in range(3):
            got = r.client.post("/instances", json={"instance_id": f"mp-{i}", "ip": "10.0.0.1", "http_port": 80})
            assert got.status_code == 200, got.text
        got = r.client.post("/instances", json={"instance_id": "mp-3", "ip": "10.0.0.1", "http_port": 80})
        assert got.status_code == 429 and "--max-instances" in got.json()["detail"]
        got = r.client.post("/instances", json={"instance_id": "mp-0", "ip": "10.0.0.1", "http_port": 80})
        assert got.status_code == 200 and got.json()["re_registered"]
    finally:
        r.stop()


# ---------------------------------------------------------------------- the rules alone
def test_log_reset_rules_at_their_edges():
    from blendmatch.service.sources.log_health import backoff, position_reset, topic_reset

    # a high watermark equal to the position is the normal caught-up case; unknown (-1001) decides nothing
    assert position_reset([0, 1], {0: 30, 1: 5}, {0: 30, 1: -1001}, None) is None
    assert position_reset([0], {0: 0}, {}, None) is None
    assert position_reset([0, 1], {0: 30, 1: 5}, {0: 30, 1: 4}, None) == (
        "high_watermark", "partition 1 ends at offset 4, below this replica's position 5")
    assert position_reset([0], {0: 30}, {0: 50}, (0, 3, 30))[0] == "rewound"
    assert topic_reset("t", None, [0])[0] == "topic_missing"
    assert topic_reset("t", [], [0, 1]) is None  # the broker reports an error for it: not a verdict
    assert topic_reset("t", [0], [0, 1])[0] == "partitions"
    assert topic_reset("t", [0, 1, 2], [0, 1]) is None  # partitions added: followed, not a reset
    assert topic_reset("t", [0], [0], "B", "A")[0] == "topic_recreated"
    assert topic_reset("t", [0], [0], "A", None) is None and topic_reset("t", [0], [0], None, "A") is None
    assert [backoff(n) for n in (1, 2, 3, 5, 6, 50)] == [0.5, 1.0, 2.0, 8.0, 10.0, 10.0]


def test_max_instances_is_decided_where_records_apply_alike_on_every_replica(broker, tmp_path):
    """Before: the bound was checked only before appending, against one replica's state, so
    records written straight to the topic (LMCache's own sink) or appends racing on several
    replicas took every replica past it. Now it is decided where records apply, in log
    order: two replicas accept and refuse the very same records and registrations."""
    from confluent_kafka import Producer

    from blendmatch.service.sources.records import CONTROL_HEADER, CONTROL_HEADER_VALUE, control_value

    topic = create_topic(broker.bootstrap)
    records = []
    for i in range(5):  # five instances, one STORE record each, straight to the topic
        records += _records(f"inst-{i}", range(1, 2), seed=i)
    records += _records("inst-1", range(2, 3), seed=1)  # a known instance goes on
    _produce(broker.bootstrap, topic, records)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(4):  # four registrations; the bound admits three
        producer.produce(topic, key=f"mp-{i}".encode(), value=control_value("register", f"mp-{i}", ts=1.0 + i,
                                                                             ip="10.0.0.1", http_port=80),
                         headers=[(CONTROL_HEADER, CONTROL_HEADER_VALUE)])
    assert producer.flush(15) == 0
    reps = [_replica(broker, topic, name, tmp_path, "--max-instances", "3", ckpt=False) for name in ("ra", "rb")]
    try:
        for r in reps:
            r.wait_up()
            r.wait_position({"0": len(records) + 4})
        for r in reps:
            stats = r.client.get("/directory/stats").json()
            assert sorted(stats["blendmatch"]["instances"]) == ["inst-0", "inst-1", "inst-2"], stats
            assert stats["num_keys"] == 4  # inst-0..2's first chunks and inst-1's second
            skipped = metric_samples(r.client.get("/metrics").text)
            assert skipped.get('blendmatch_kafka_records_skipped_total{reason="instance_bound"}') == 2
            assert sorted(i["instance_id"] for i in r.client.get("/instances").json()["instances"]) == [
                "mp-0", "mp-1", "mp-2"]
        got = reps[0].client.post("/instances", json={"instance_id": "mp-9", "ip": "10.0.0.1", "http_port": 80})
        assert got.status_code == 429, got.text
    finally:
        for r in reps:
            r.stop()


def test_a_resync_tells_kv_events_subscribers_alike_on_every_replica(broker, tmp_path):
    """Before: after a resync (--on-log-reset resync) KV-events subscribers were told nothing
    and kept every block of the lost log. Now: each replica publishes AllBlocksCleared (vLLM's
    class) on every topic that held blocks, before the rebuilt state, and two replicas that
    applied the same log publish the very same messages, seqs included."""
    import zmq

    from kafka_support import free_port
    from kv_events_support import Subscriber
    from vllm_events_support import RELEASES, decode_batch, kv_events_file

    kv_events_file(RELEASES["map"])  # vLLM's classes (skips with the reason when they cannot be fetched)
    access = tmp_path / "access.toml"
    access.write_text('[[network]]\nname = "here"\ncidrs = ["127.0.0.0/8"]\n'
                      'roles = ["producer", "reader", "admin", "metrics"]\n\n[kv_events]\nexpose = true\n')
    topic = create_topic(broker.bootstrap)
    eps, reps = {}, []
    for name in ("ca", "cb"):
        pub, rep = free_port(), free_port()
        eps[name] = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
        reps.append(_replica(broker, topic, name, tmp_path, "--on-log-reset", "resync", "--access-file", str(access),
                             "--kv-events-endpoint", f"tcp://*:{pub}", "--kv-events-replay-endpoint",
                             f"tcp://*:{rep}", ckpt=False))
    try:
        old = _produce(broker.bootstrap, topic, _records("mp-old", range(1, 11), seed=4))
        for r in reps:
            r.wait_up()
            r.wait_position(end_offsets(old))
        broker.restart_empty()
        _recreate_topic(broker.bootstrap, topic)
        new = _produce(broker.bootstrap, topic, _records("mp-new", range(1, 6), seed=5))

        def rebuilt(r: Replica) -> bool:
            ls = r.log_stats()
            return ls["log_resets"] >= 1 and ls["log_reset"] is None and ls["position"] == end_offsets(new)

        streams = []
        for r, name in zip(reps, ("ca", "cb")):
            wait_for(lambda: rebuilt(r), 60, f"{name}'s resync")
            wait_for(lambda: r.client.get("/directory/stats").json()["blendmatch"]["kv_events"]["next_seq"] >= 16,
                     30, f"{name}'s messages")
            ctx = zmq.Context()
            try:
                s = Subscriber(ctx, *eps[name], "map")
                s.replay_from(0)
                s.close()
            finally:
                ctx.destroy(linger=0)
            streams.append(s.stream)
            kinds = [[type(ev).__name__ for ev in decode_batch("map", p).events] for _, _, p in s.stream]
            # 10 old stores, the clear of the old instance's topic, then the 5 new stores
            assert kinds == [["BlockStored"]] * 10 + [["AllBlocksCleared"]] + [["BlockStored"]] * 5, kinds
            assert s.stream[10][0] == b"kv@mp-old@llama" and s.stream[10][1] == 10
            assert {t for t, _, _ in s.holders} == {"kv@mp-new@llama"} and len(s.holders) == 5
        assert streams[0] == streams[1]  # the same bytes and seqs on both replicas
    finally:
        for r in reps:
            r.stop()
