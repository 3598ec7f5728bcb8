"""What a replica knows about its log besides positions: is the broker reachable, did the
log lose records under us, has a cold replica caught up; and what ``/readyz`` and
``/healthz`` say about it.

Question answered: "can this replica's answers be trusted, and if not, should it be taken
out of rotation (not ready) or restarted (not live)?" The rules, one place each:

- **Broker outage** (a metadata call, offset call or fetch failing with a transient error):
  every failure is counted (``blendmatch_kafka_broker_errors_total{op}``) and the caller
  retries with :func:`backoff` (0.5 s doubling to 10 s); the first success after a failure
  counts one reconnect (``blendmatch_kafka_reconnects_total``) and logs how long it was
  gone. During the outage the replica stays ready (its answers are those of the last
  record applied, as on any replica; taking the whole fleet out of rotation for a broker
  outage would turn stale-by-seconds into an outage) and ``/readyz`` carries a warning.
- **Log reset** (the broker lost records this replica applied: a high watermark below the
  position, a record below the position, a recreated topic, fewer partitions):
  :func:`position_reset` and :func:`topic_reset` say so; never skipped silently. Counted
  (``blendmatch_kafka_log_resets_total{reason}``), logged at ERROR, and with
  ``--on-log-reset fail`` the replica is neither ready nor live until an operator acts;
  with ``resync`` it is not ready until it rebuilt its state from the new log's start.
- **Cold start** (no checkpoint restored): not ready until every partition reached the high
  watermark first seen at start, whatever ``--max-ready-lag`` allows: a replica without
  its peers' answers must not be routed to.
- **A topic that does not exist** (a misspelled ``--kafka-topic``, or a fleet whose topic
  is not created yet): not ready, naming the topic, until it appears; never created unless
  ``--kafka-create-topic`` asks for it (``kafka.py``). Live meanwhile: a restart would not
  make it appear.
- **A thread that died** (a bug, a fatal client error): not live, with the reason, so that
  an orchestrator restarts the process.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from prometheus_client import Counter, Gauge

__all__ = ["LogHealth", "backoff", "position_reset", "topic_reset"]

log = logging.getLogger("blendmatch.service.kafka")

_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 10.0


def backoff(failures: int) -> float:
    """Seconds to wait before retry number ``failures`` (1-based): 0.5 s doubling, at most 10 s."""
    return min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * (2 ** max(0, failures - 1)))


def position_reset(partitions: list[int], positions: dict[int, int], highs: dict[int, int],
                   rewound: Optional[tuple[int, int, int]]) -> Optional[tuple[str, str]]:
    """``(kind, reason)`` when the log lost records this replica applied, judged by
    positions: a record delivered below a position (``rewound``: partition, offset,
    position), or a partition whose high watermark (``highs``, as last fetched) is below the
    next offset to apply (``positions``). None otherwise."""
    if rewound is not None:
        p, o, at = rewound
        return "rewound", f"partition {p} delivered offset {o} below this replica's position {at}"
    for p in partitions:
        high, at = highs.get(p), positions.get(p, 0)
        if high is not None and 0 <= high < at:
            return "high_watermark", f"partition {p} ends at offset {high}, below this replica's position {at}"
    return None


def topic_reset(topic: str, partitions: Optional[list[int]], followed: list[int], topic_id: Optional[str] = None,
                known_id: Optional[str] = None) -> Optional[tuple[str, str]]:
    """``(kind, reason)`` when the topic itself changed under the replica: gone
    (``partitions`` None), fewer partitions than ``followed`` (Kafka only ever adds them),
    or another topic id than ``known_id`` (recreated). ``[]`` partitions (the broker reports
    an error for the topic) and unknown ids decide nothing."""
    if partitions is None:
        return "topic_missing", f"topic {topic} no longer exists on the broker"
    if partitions and any(p not in partitions for p in followed):
        return "partitions", f"topic {topic} has partitions {partitions}, this replica followed {followed}"
    if topic_id is not None and known_id is not None and topic_id != known_id:
        return "topic_recreated", f"topic {topic} was recreated (id {topic_id}, was {known_id})"
    return None


class LogHealth:
    """One per source; thread-safe (fetch, apply, producer and request threads report)."""

    def __init__(self, registry: object, on_reset: str) -> None:
        self.on_reset = on_reset
        self._lock = threading.Lock()
        self.down_since: Optional[float] = None
        self.last_error: Optional[str] = None
        self.reconnects = 0
        #: The reset detected and not yet recovered from (None: none).
        self.reset: Optional[str] = None
        self.resets = 0
        #: Per partition, the offset a cold replica must reach before it is ready (None:
        #: not a cold start, or caught up).
        self.catch_up: Optional[dict[int, int]] = None
        #: Why a thread of the source died (None: all running).
        self.dead: Optional[str] = None
        #: The topic while the broker does not have it (None: it exists, or not checked yet).
        self.missing_topic: Optional[str] = None
        self.m_errors = Counter("blendmatch_kafka_broker_errors", "transient broker errors, retried", ["op"],
                                registry=registry)
        self.m_reconnects = Counter("blendmatch_kafka_reconnects", "broker reachable again after failures",
                                    registry=registry)
        self.m_down = Gauge("blendmatch_kafka_broker_unreachable", "1 while the broker is unreachable",
                            registry=registry)
        self.m_resets = Counter("blendmatch_kafka_log_resets", "log resets detected (records lost by the broker)",
                                ["reason"], registry=registry)

    # ------------------------------------------------------------------ outages
    def broker_error(self, op: str, exc: object) -> None:
        """A transient failure of ``op``: counted; the first of an outage logged."""
        self.m_errors.labels(op).inc()
        with self._lock:
            first = self.down_since is None
            if first:
                self.down_since = time.monotonic()
            self.last_error = f"{op}: {exc}"
        self.m_down.set(1)
        if first:
            log.warning("kafka broker unreachable (%s: %s): retrying with backoff; answers stay as of the last "
                        "record applied", op, exc)

    def broker_ok(self) -> None:
        """A call to the broker succeeded: ends an outage (one reconnect)."""
        if self.down_since is None:
            return
        with self._lock:
            since, self.down_since = self.down_since, None
        if since is None:
            return
        self.reconnects += 1
        self.m_reconnects.inc()
        self.m_down.set(0)
        log.warning("kafka broker reachable again after %.1f s", time.monotonic() - since)

    def unreachable_s(self) -> Optional[float]:
        since = self.down_since
        return None if since is None else time.monotonic() - since

    # ------------------------------------------------------------------ log resets
    def log_reset(self, kind: str, reason: str) -> None:
        """A reset detected (``kind``: the rule that saw it): counted and remembered until
        a resync completes (``progress``) or, with ``fail``, for the process's life."""
        self.reset = reason
        self.resets += 1
        self.m_resets.labels(kind).inc()

    # ------------------------------------------------------------------ verdicts
    def reasons(self, positions: dict[int, int]) -> list[str]:
        """Why the replica is not ready (empty: the log says nothing against it)."""
        out = []
        if self.dead is not None:
            out.append(f"event log source stopped: {self.dead}")
        if self.missing_topic is not None:
            out.append(f"topic {self.missing_topic} does not exist on the broker: waiting for it (is --kafka-topic "
                       "the MP servers' --coordinator-kafka-topic? --kafka-create-topic creates it)")
        if self.reset is not None:
            what = ("rebuilding from the new log's start (--on-log-reset resync)" if self.on_reset == "resync" else
                    "not following it (--on-log-reset fail): restart it with --on-log-reset resync, or with a new "
                    "--replica-id and without its checkpoint")
            out.append(f"event log reset: {self.reset}; {what}")
        target = self.catch_up
        if target is not None:
            behind = {p: (positions.get(p, 0), o) for p, o in target.items() if positions.get(p, 0) < o}
            if behind:
                out.append("catching up to the log's end seen at a start without checkpoint: " + ", ".join(
                    f"partition {p} at {at} of {o}" for p, (at, o) in sorted(behind.items())))
        return out

    def progress(self, positions: dict[int, int]) -> None:
        """Fetch thread, every round: end the catch-up (and a resync) once every partition
        reached its target."""
        target = self.catch_up
        if target is None or any(positions.get(p, 0) < o for p, o in target.items()):
            return
        self.catch_up = None
        if self.reset is not None and self.on_reset == "resync":
            log.warning("resync after the log reset (%s) complete: rebuilt from the new log up to %s", self.reset,
                        target)
            self.reset = None
        else:
            log.info("caught up to the log's end seen at start: %s", target)

    def warnings(self) -> list[str]:
        gone = self.unreachable_s()
        if gone is None:
            return []
        return [f"event log broker unreachable for {gone:.0f} s ({self.last_error}); answers are as of the last "
                "record applied; appends (POST /events, /instances) answer 503 meanwhile"]

    def not_live(self) -> Optional[str]:
        """Why the process should be restarted (``/healthz`` 503), or None."""
        if self.dead is not None:
            return f"event log source stopped: {self.dead}"
        if self.reset is not None and self.on_reset == "fail":
            return f"event log reset: {self.reset} (--on-log-reset fail)"
        return None
