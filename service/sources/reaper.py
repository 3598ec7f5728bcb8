"""Which replica of a fleet holds the reaper role (Kafka mode).

Every replica is a member of the consumer group ``<group>-reaper`` on the one-partition
topic ``<topic>-reaper`` (``--kafka-reaper-topic``); the member that owns partition 0 holds
the role. The broker moves it when the holder leaves (at once) or dies (after
``--kafka-session-timeout-ms``). Only the holder publishes expiry fences (``records.py``,
``KafkaSource.reap_once``); every replica applies them. Broker errors while looking for the
topic are retried with the source's backoff (``log_health.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from confluent_kafka import Consumer
from prometheus_client import Gauge

__all__ = ["ReaperMembership"]

log = logging.getLogger("blendmatch.service.kafka")


class ReaperMembership:
    """This replica's membership of the reaper group; :attr:`holds` says whether it holds the role."""

    def __init__(self, bootstrap: str, group: str, topic: str, replica_id: str, session_timeout_ms: int,
                 registry: Any) -> None:
        self.bootstrap, self.group, self.topic, self.replica_id = bootstrap, group, topic, replica_id
        self.session_timeout_ms = session_timeout_ms
        self.holds = False
        self.m_role = Gauge("blendmatch_kafka_reaper_role", "1 while this replica holds the reaper role",
                            registry=registry)

    def run(self, stop: threading.Event, restored: Callable[[], bool], retry: Callable[[str, Callable], Any]) -> None:
        """The membership thread: joins once the restore is done, leaves at the stop."""
        timeout_ms = self.session_timeout_ms
        while not restored() and not stop.is_set():
            time.sleep(0.02)
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "client.id": f"blendmatch-reaper-{self.replica_id}", "group.protocol": "classic",
                             "session.timeout.ms": timeout_ms, "heartbeat.interval.ms": max(100, timeout_ms // 4),
                             "enable.auto.commit": False, "auto.offset.reset": "latest"})

        def on_assign(c: Any, parts: list) -> None:
            self._set(any(tp.partition == 0 for tp in parts))

        def on_revoke(c: Any, parts: list) -> None:
            self._set(False)

        while not stop.is_set():  # the topic may be created by the consumer thread
            md = retry("reaper metadata", lambda: consumer.list_topics(timeout=5))
            if md is not None and self.topic in md.topics:
                break
            stop.wait(0.2)
        consumer.subscribe([self.topic], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_revoke)
        try:
            while not stop.is_set():
                consumer.poll(0.1)
        finally:
            self._set(False)
            consumer.close()  # leaves the group: the role moves at once

    def _set(self, holds: bool) -> None:
        if holds != self.holds:
            log.info("replica %s %s the reaper role", self.replica_id, "takes" if holds else "gives up")
        self.holds = holds
        self.m_role.set(1 if holds else 0)
