"""Warnings that a flood of bad input cannot turn into a flood of log lines.

Question answered: "how does a server log every kind of refusal without letting a peer
write the log for it?" :class:`RateLimitedLog` writes at most one WARNING per kind per
interval and says, on the next line of that kind, how many it left out. One helper for
every room of the service that logs what peers send: the HTTP limits (``limits.py``) and
the KV-events replay socket (``publish/replay.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """One WARNING per kind per ``interval`` seconds on ``logger``, saying how many were not
    logged. Not thread-safe: each owner calls it from one thread (the event loop, the
    publisher's thread)."""

    def __init__(self, logger: logging.Logger, interval: float) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        suffix = f" ({quiet} more since the last such line)" if quiet else ""
        self.logger.warning(message + "%s", *args, suffix)
