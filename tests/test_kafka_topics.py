"""The topic a replica follows, against a real broker (tansu): a misspelled or not yet
created topic, one created on request, and one deleted under a running replica (issue 47,
items 4 and 5); and the log a broker that cannot be reached costs (issue 45, item 4).

Each replica is a ``blendmatch serve --event-transport kafka`` subprocess
(``kafka_support.Replica``): a crash of the Kafka client library ends that process, never
the test run. Marked ``kafka``; skipped only when the broker cannot start.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from typing import Any

import httpx
import pytest

from blendmatch.service.sources.records import lmcache_record_value
from kafka_support import (Replica, broker, create_topic, end_offsets, free_port, lmcache_producer,  # noqa: F401
                           wait_for)
from service_support import chunks, store

pytestmark = pytest.mark.kafka


def _topics(bootstrap: str) -> dict[str, int]:
    """Every topic on the broker and its partition count (listed, never named: naming a
    missing topic makes tansu create it)."""
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    return {name: len(t.partitions) for name, t in md.topics.items()}


def _produce(bootstrap: str, topic: str, n: int, seed: int) -> list[tuple[int, int]]:
    producer = lmcache_producer(bootstrap)
    positions: list[tuple[int, int]] = []

    def done(err: Any, msg: Any) -> None:
        assert err is None, err
        positions.append((msg.partition(), msg.offset()))

    for s in range(1, n + 1):
        value = lmcache_record_value(store("mp-a", s, chunks(1, seed=seed * 1000 + s), first_hash=seed * 1000 + s,
                                           incarnation=1))
        producer.produce(topic, key=b"mp-a", value=value, on_delivery=done)
    assert producer.flush(15) == 0
    return positions


def _replica(bootstrap: str, topic: str, name: str, tmp_path: Any, group: str, *extra: str) -> Replica:
    return Replica(bootstrap, topic, name, group, str(tmp_path / f"{name}.ckpt"), "--checkpoint-interval", "0.5",
                   *extra, log_path=tmp_path / f"{name}.log")


def _ready(r: Replica) -> tuple[int, list[str]]:
    got = r.client.get("/readyz")
    return got.status_code, got.json().get("reasons", [])


def _stop(*replicas: Replica) -> None:
    for r in replicas:
        r.stop()


# ---------------------------------------------------------------------- issue 47, item 5
def test_a_misspelled_topic_is_not_created_and_the_replica_is_not_ready(broker, tmp_path):
    """Today: a replica started on ``bm-event`` while the fleet writes ``bm-events`` logged
    "does not exist: creating it", created it, answered /readyz 200, took the reaper role
    and answered every lookup empty. Now: the topic is not created, /readyz answers 503
    naming it (/healthz stays 200: a restart would not help), appends answer 503 and
    create nothing, the reaper role stays with the replica of the real topic; and once the
    topic appears (a fleet whose topic is created after its replicas), the replica follows
    it and becomes ready."""
    fleet_topic = f"bm-events-{uuid.uuid4().hex[:8]}"
    typo = fleet_topic.replace("bm-events", "bm-event")
    create_topic_named(broker.bootstrap, fleet_topic)
    positions = _produce(broker.bootstrap, fleet_topic, 8, seed=1)
    group = f"g-{uuid.uuid4().hex[:8]}"  # one fleet: one reaper group
    good = _replica(broker.bootstrap, fleet_topic, "good", tmp_path, group)
    bad = _replica(broker.bootstrap, typo, "bad", tmp_path, group)
    try:
        good.wait_up()
        good.wait_position(end_offsets(positions))
        wait_for(lambda: good.log_stats()["reaper_role"], 60, "the replica of the real topic to hold the reaper role")
        bad.wait_up()
        status, reasons = wait_for(lambda: (got := _ready(bad))[0] == 503 and any(typo in x for x in got[1]) and got,
                                   30, "/readyz 503 naming the missing topic")
        assert any("does not exist" in x and "--kafka-create-topic" in x for x in reasons), reasons
        assert bad.client.get("/healthz").status_code == 200
        appended = bad.client.post("/events", json={"batches": [store("mp-b", 1, chunks(1, seed=5), first_hash=5)]})
        assert appended.status_code == 503 and typo in appended.json()["detail"], appended.text
        time.sleep(3)  # the reaper thread, metadata refreshes and the append had their chance to create it
        assert typo not in _topics(broker.bootstrap) and f"{typo}-reaper" not in _topics(broker.bootstrap)
        assert _ready(bad)[0] == 503
        assert not bad.log_stats()["reaper_role"] and good.log_stats()["reaper_role"]
        log = bad.tail()
        said = log.count(f"topic {typo} does not exist on the broker {broker.bootstrap}")
        assert "creating it" not in log and 1 <= said <= 2, log  # once a minute (a loaded machine may take one)

        create_topic_named(broker.bootstrap, typo)  # a fleet whose topic appears after its replica started
        more = _produce(broker.bootstrap, typo, 3, seed=2)
        wait_for(lambda: _ready(bad)[0] == 200, 60, "ready once the topic exists")
        bad.wait_position(end_offsets(more))
        assert bad.client.get("/directory/stats").json()["num_keys"] == 3
    finally:
        _stop(bad, good)


def create_topic_named(bootstrap: str, name: str, partitions: int = 1) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(10)


def test_kafka_create_topic_creates_a_missing_topic_with_one_partition(broker, tmp_path):
    """``--kafka-create-topic``: the replica creates its missing topic (one partition),
    says so once, and is ready."""
    topic = f"new-{uuid.uuid4().hex[:8]}"
    r = _replica(broker.bootstrap, topic, "c", tmp_path, f"g-{uuid.uuid4().hex[:8]}", "--kafka-create-topic")
    try:
        r.wait_up()
        wait_for(lambda: _ready(r)[0] == 200, 30, "ready on the topic it created")
        assert _topics(broker.bootstrap).get(topic) == 1
        got = r.client.post("/events", json={"batches": [store("mp-c", 1, chunks(1, seed=7), first_hash=7)]})
        assert got.status_code == 200, got.text
        assert "creating it with one partition (--kafka-create-topic)" in r.tail()
    finally:
        r.stop()


# ---------------------------------------------------------------------- issue 47, item 4
def test_deleting_the_topic_under_a_replica_is_loud(broker, tmp_path):
    """Today: deleting the topic while a replica consumes ends it with SIGSEGV about 2 s
    later and nothing in its log (librdkafka 2.5.0-2.16.x crash in
    ``rd_kafka_metadata_update_op`` on tansu's Fetch answer for the deleted topic; plain
    confluent-kafka crashes the same way). Now the replica either survives and answers
    503 naming the topic, or, where the client library still crashes, dies with a non-zero
    status and a CRITICAL line naming the topic, and once restarted (as an orchestrator
    does) is not ready, with the topic named in the reason."""
    from confluent_kafka.admin import AdminClient

    topic = create_topic(broker.bootstrap)
    positions = _produce(broker.bootstrap, topic, 5, seed=3)
    group = f"g-{uuid.uuid4().hex[:8]}"
    r = _replica(broker.bootstrap, topic, "d", tmp_path, group)
    try:
        r.wait_up()
        r.wait_position(end_offsets(positions))
        wait_for(lambda: (tmp_path / "d.ckpt").exists(), 15, "a checkpoint holding the position")
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})  # kept until the result
        admin.delete_topics([topic])[topic].result(10)

        def loud() -> Any:
            try:
                status, reasons = _ready(r)
            except httpx.TransportError:
                status, reasons = 0, []
            if not r.alive():
                return "exited"
            return status == 503 and any(topic in x for x in reasons) and "survived"

        outcome = wait_for(loud, 40, "the replica to die loudly or answer 503 naming the topic", every=0.2)
        if outcome == "exited":
            assert r.proc.returncode != 0, r.tail()
            line = rf"CRITICAL blendmatch.service.kafka: replica d \(pid {r.proc.pid}\) died without stopping while " \
                   rf"following topic {re.escape(topic)} on {re.escape(broker.bootstrap)}"
            wait_for(lambda: re.search(line, r.tail()), 10, "the watcher's line naming the topic")
            r = r.restart()  # what the orchestrator does
            r.wait_up()
            status, reasons = wait_for(lambda: (got := _ready(r))[0] == 503 and any(topic in x for x in got[1])
                                       and got, 30, "/readyz 503 naming the topic after the restart")
            assert r.alive()
        else:
            assert r.client.get("/healthz").status_code in (200, 503)
    finally:
        r.stop()


# ---------------------------------------------------------------------- issue 45, item 4
def test_a_broker_that_cannot_be_reached_costs_a_few_log_lines(tmp_path):
    """Today: with nothing listening at the broker's address, librdkafka printed 20-60
    ``%3|...|FAIL|`` lines a second to stderr. Now its log goes through Python logging,
    at most one line per kind a minute, naming the broker; the one useful WARNING and the
    /readyz reason stay."""
    pytest.importorskip("confluent_kafka", reason="confluent-kafka is not installed (the test extra has it)")
    port = free_port()  # nothing listens there
    bootstrap = f"127.0.0.1:{port}"
    r = _replica(bootstrap, "bm-events", "down", tmp_path, "g-down")
    try:
        r.wait_up()
        time.sleep(10)
        lines = r.log_path.read_text().splitlines()
        raw = [x for x in lines if re.match(r"%\d\|", x)]
        client = [x for x in lines if "librdkafka" in x]
        assert raw == [], raw[:5]
        assert 1 <= len(client) <= 6, client
        assert any(bootstrap in x for x in client), client
        assert sum("kafka broker unreachable" in x for x in lines) == 1, lines[-20:]
        assert len(lines) < 60, lines  # start-up lines included
        status, reasons = _ready(r)
        assert status == 503 and reasons, reasons
    finally:
        r.stop()
