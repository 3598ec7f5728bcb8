"""Whether a replica's topic exists, and who may create it (Kafka mode).

Question answered: "what does a replica do when ``--kafka-topic`` names a topic the broker
does not have?" It never creates it unless ``--kafka-create-topic`` asks (then with one
partition): a misspelled topic auto-created by the replica used to make it ready on an
empty log, take the reaper role and answer every lookup empty. Instead, until the topic
appears, ``/readyz`` answers 503 naming it (``log_health.py``), appends answer 503 and
append nothing, the reaper role is not taken (``KafkaSource._reaper_eligible``), and a
WARNING says so once a minute; a replica started before its fleet's topic exists follows it
once it appears (checked every second).

Every metadata request here lists all topics and never names one: a request naming a
missing topic creates it on a broker with topic auto-creation on (tansu always, with 4
partitions; Kafka's ``auto.create.topics.enable``). ``<topic>-reaper`` (this package's own)
is created when missing once the topic exists, so a misspelled topic leaves nothing behind.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from .client_log import drain
from .log_health import LogHealth

__all__ = ["TopicPresence"]

log = logging.getLogger("blendmatch.service.kafka")

_CHECK_EVERY_S = 1.0   # how often a replica waiting for its topic lists the broker's topics
_SAY_EVERY_S = 60.0    # and how often it says so in the log


class TopicPresence:
    """One per source. :attr:`seen`: the topic existed at the last check (the fetch
    thread's; appends check for themselves until then)."""

    def __init__(self, topic: str, reaper_topic: str, bootstrap: str, create: bool, health: LogHealth,
                 admin: Callable[[], AdminClient]) -> None:
        self.topic, self.reaper_topic, self.bootstrap, self.create = topic, reaper_topic, bootstrap, create
        self.health = health
        self._admin = admin
        self._append_admin: Optional[AdminClient] = None
        self.seen = False

    def exists(self, admin: AdminClient, timeout: float = 10.0) -> bool:
        """Whether the broker has the topic. Raises KafkaException on a broker error."""
        try:
            return self.topic in admin.list_topics(timeout=timeout).topics
        finally:
            drain(admin)

    def ensure(self) -> None:
        """Create the topic when missing only with ``--kafka-create-topic``; the reaper topic
        when missing once the topic exists. Raises KafkaException on a broker error."""
        admin = self._admin()
        try:
            md = admin.list_topics(timeout=10)
            want = []
            if self.topic not in md.topics and self.create:
                log.warning("topic %s does not exist: creating it with one partition (--kafka-create-topic)",
                            self.topic)
                want.append(NewTopic(self.topic, 1, 1))
            if self.reaper_topic not in md.topics and (self.topic in md.topics or want):
                want.append(NewTopic(self.reaper_topic, 1, 1))
            for fut in (admin.create_topics(want).values() if want else ()):
                try:
                    fut.result(10)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise
        finally:
            drain(admin)

    def wait(self, stop: threading.Event, retry: Callable[[str, Callable[[], Any]], Any]) -> bool:
        """Until the topic exists (True) or ``stop`` (False); not ready meanwhile (module
        docstring). ``retry``: the source's, for broker errors."""
        admin = self._admin()
        said = None
        while not stop.is_set():
            found = retry("metadata", lambda: self.exists(admin))
            if found is None:
                return False
            if found:
                if self.health.missing_topic is not None:
                    log.warning("topic %s now exists on the broker: following it", self.topic)
                self.health.missing_topic = None
                self.seen = True
                return True
            self.seen = False
            self.health.missing_topic = self.topic
            now = time.monotonic()
            if said is None or now - said >= _SAY_EVERY_S:
                said = now
                log.warning("topic %s does not exist on the broker %s: not ready until it does (is --kafka-topic the "
                            "MP servers' --coordinator-kafka-topic? --kafka-create-topic creates it)", self.topic,
                            self.bootstrap)
            stop.wait(_CHECK_EVERY_S)
        return False

    def append_refusal(self, timeout: float) -> Optional[str]:
        """Why an append must be refused (None: the topic exists), asked before the first
        append while the fetch thread has not seen the topic: a producer naming a missing
        topic would create it on a broker that auto-creates topics. Within ``timeout``
        (--kafka-produce-timeout). Blocking: call off the event loop."""
        if self.seen:
            return None
        if self._append_admin is None:
            self._append_admin = self._admin()
        try:
            if self.exists(self._append_admin, timeout):
                return None
        except KafkaException as exc:
            return (f"could not check within {timeout:g} s (--kafka-produce-timeout) that topic {self.topic} exists: "
                    f"the broker may be unreachable ({exc}); nothing appended, resending is safe")
        return (f"topic {self.topic} does not exist on the broker: nothing appended (it is not created by an append; "
                "is --kafka-topic right? --kafka-create-topic creates it)")
