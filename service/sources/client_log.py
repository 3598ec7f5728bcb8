"""librdkafka's own log lines, through Python logging and rate-limited per kind.

Question answered: "what does a broker that cannot be reached cost the log?" Left alone,
librdkafka prints every failed connect to stderr (``%3|...|FAIL|...``): measured, 2,260
lines in 48 s with the broker down, burying the one useful WARNING of ``log_health.py``.
Every client of this package (the consumer, the producer, the reaper's consumer, the admin
clients) gets a :class:`ClientLog` as its ``logger`` setting (confluent-kafka's documented
way to route the log through Python logging); it logs to ``blendmatch.service.kafka.client``
at the level librdkafka gave, at most one line per kind (librdkafka's facility, such as
``FAIL`` or ``ERROR``) per :data:`INTERVAL_S` (60 s), each saying how many of that kind were
left out since the line before. librdkafka's text names the broker (``host:port/id``).

confluent-kafka delivers a client's log lines from that client's ``poll``/``consume`` (the
log queue becomes the client's main queue when ``logger`` is set): a client that is never
polled keeps them queued, so the admin clients here are polled after each call
(:func:`drain`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["ClientLog", "INTERVAL_S", "drain"]

log = logging.getLogger("blendmatch.service.kafka.client")

#: At most one line per kind (librdkafka facility) per this many seconds.
INTERVAL_S = 60.0


class ClientLog:
    """A ``logger`` for confluent-kafka's configuration: it calls ``log(level, fmt, fac,
    client name, message)`` (the ``logging.Logger`` method); this one forwards at most one
    line per facility per ``interval`` seconds. Shared by every client of one source and
    thread-safe (each client logs from the thread that polls it)."""

    def __init__(self, interval: float = INTERVAL_S, target: logging.Logger = log) -> None:
        self.interval = interval
        self.target = target
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        #: Lines received and lines forwarded (for tests and /directory/stats).
        self.received = 0
        self.forwarded = 0

    def log(self, level: int, msg: str, *args: Any) -> None:
        fac = str(args[0]) if args else "?"
        now = time.monotonic()
        with self._lock:
            self.received += 1
            last = self._last.get(fac)
            if last is not None and now - last < self.interval:
                self._quiet[fac] = self._quiet.get(fac, 0) + 1
                return
            self._last[fac] = now
            quiet = self._quiet.pop(fac, 0)
            self.forwarded += 1
        suffix = f" ({quiet} more {fac} lines in the last {now - last:.0f} s)" if quiet and last is not None else ""
        self.target.log(level, "librdkafka " + msg + "%s", *args, suffix)

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging.Logger's name
        return self.target.isEnabledFor(level)


def drain(client: Any) -> None:
    """Deliver the log lines an admin client queued (it is not polled otherwise)."""
    try:
        client.poll(0)
    except Exception:  # noqa: BLE001 - a log delivery must never fail the call it follows
        log.debug("polling an admin client for its log failed", exc_info=True)
