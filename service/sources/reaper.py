"""Which replica of a fleet holds the reaper role (Kafka mode).

Every replica is a member of the consumer group ``<group>-reaper`` on the one-partition
topic ``<topic>-reaper`` (``--kafka-reaper-topic``); the member that owns partition 0 holds
the role. The broker moves it when the holder leaves (at once) or dies (after
``--kafka-session-timeout-ms``). Only the holder publishes expiry fences (``records.py``,
``KafkaSource.reap_once``); every replica applies them. Broker errors while looking for the
topic are retried with the source's backoff (``log_health.py``).

Only an eligible replica is a member (``KafkaSource._reaper_eligible``: restored, its topic
exists, nothing against its readiness from the log): a replica of a missing or misspelled
topic, one catching up, or one stopped by a log reset never holds the role, and a member
that stops being eligible leaves the group (the role moves at once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from confluent_kafka import Consumer
from prometheus_client import Gauge

__all__ = ["ReaperMembership"]

log = logging.getLogger("blendmatch.service.kafka")


class ReaperMembership:
    """This replica's membership of the reaper group; :attr:`holds` says whether it holds the role."""

    def __init__(self, bootstrap: str, group: str, topic: str, replica_id: str, session_timeout_ms: int,
                 registry: Any, logger: Optional[Any] = None) -> None:
        self.bootstrap, self.group, self.topic, self.replica_id = bootstrap, group, topic, replica_id
        self.logger = logger  # librdkafka's log (client_log.py)
        self.session_timeout_ms = session_timeout_ms
        self.holds = False
        self.m_role = Gauge("blendmatch_kafka_reaper_role", "1 while this replica holds the reaper role",
                            registry=registry)

    def run(self, stop: threading.Event, eligible: Callable[[], bool],
            retry: Callable[[str, Callable], Any]) -> None:
        """The membership thread: a member while ``eligible()``, out of the group otherwise,
        until the stop."""
        while not stop.is_set():
            if not eligible():
                stop.wait(0.1)
                continue
            self._member(stop, eligible, retry)

    def _member(self, stop: threading.Event, eligible: Callable[[], bool],
                retry: Callable[[str, Callable], Any]) -> None:
        """One membership: joins, then leaves at the stop or once no longer eligible."""
        timeout_ms = self.session_timeout_ms
        conf = {"bootstrap.servers": self.bootstrap, "group.id": self.group,
                "client.id": f"blendmatch-reaper-{self.replica_id}", "group.protocol": "classic",
                "session.timeout.ms": timeout_ms, "heartbeat.interval.ms": max(100, timeout_ms // 4),
                "enable.auto.commit": False, "auto.offset.reset": "latest"}
        if self.logger is not None:
            conf["logger"] = self.logger
        consumer = Consumer(conf)

        def on_assign(c: Any, parts: list) -> None:
            self._set(any(tp.partition == 0 for tp in parts))

        def on_revoke(c: Any, parts: list) -> None:
            self._set(False)

        try:
            while not stop.is_set():  # the topic may be created by the consumer thread
                md = retry("reaper metadata", lambda: consumer.list_topics(timeout=5))
                if md is not None and self.topic in md.topics:
                    break
                stop.wait(0.2)
            else:
                return
            consumer.subscribe([self.topic], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_revoke)
            while not stop.is_set() and eligible():
                consumer.poll(0.1)
            if not stop.is_set():
                log.info("replica %s leaves the reaper group: not eligible (topic missing, catching up or log reset)",
                         self.replica_id)
        finally:
            self._set(False)
            consumer.close()  # leaves the group: the role moves at once

    def _set(self, holds: bool) -> None:
        if holds != self.holds:
            log.info("replica %s %s the reaper role", self.replica_id, "takes" if holds else "gives up")
        self.holds = holds
        self.m_role.set(1 if holds else 0)
